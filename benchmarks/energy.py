"""Energy: the forecast against published measurements, and the one activity the power model fits.

    python benchmarks/energy.py --part published   # writes docs/samples/energy-published.md
    python benchmarks/energy.py --part fit         # ACTIVITY["memory"] that makes the fitted row exact
    python benchmarks/energy.py --part gpu         # a lent GPU's measured joules beside the forecast's (GPU check)

The published measurements (H100 SXM, bfloat16 unless named, vLLM, NVML's energy counter):

- "Alice" energy benchmark (r/FunMachineLearning, 2026, NVML at 100 ms, vLLM AsyncLLMEngine): Mistral-7B, batch 1:
  732 µWh per token (2.635 J); batch 128: 13.8 µWh (0.0497 J); GPTQ 4-bit -25% energy per token against bf16 (AWQ
  +145%: a kernel dtypelab does not model). The workload's lengths are not given: a 128-token prompt and 256 tokens
  generated are assumed here.
- ML.ENERGY leaderboard v3 (ml.energy blog, "LLM Inference Energy: A Longitudinal Analysis", vLLM 0.11.1):
  Llama-3.1-8B at batch 64 (one H100): 0.12 J per token; its "text conversation" task averages 717 generated tokens
  (the v3 post); a 512-token prompt is assumed here.
- The same v3 analysis: FP8 used more energy per token than BF16 at batch 8-16 and less at batch 64 and above (a
  direction, no figures).

The batch-1 row fits ``ACTIVITY["memory"]`` (``--part fit``); every other row is held out. Compiled policies (vLLM
captures CUDA graphs: launch overhead is not what it measures).
"""

from __future__ import annotations

import argparse
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")
OUT = os.path.join(ROOT, "docs", "samples", "energy-published.md")
ALICE = "Alice energy benchmark (Reddit, 2026)"
MLENERGY = "ML.ENERGY leaderboard v3"
# (source, config, prompt, generated, batch, policy, published J per generated token, fitted here)
ROWS = (
    (ALICE, "mistral-7b", 128, 256, 1, "bf16", 2.635, True),
    (ALICE, "mistral-7b", 128, 256, 128, "bf16", 0.0497, False),
    (MLENERGY, "llama3.1-8b", 512, 717, 64, "bf16", 0.12, False),
)
# (source, config, prompt, generated, batch, policy, its published energy over bf16's at the same batch)
RATIOS = ((ALICE, "mistral-7b", 128, 256, 128, "int4-wo", 0.75),)
DIRECTION = ((8, "more"), (16, "more"), (64, "less"))  # ML.ENERGY v3: fp8 against bf16, Llama-3.1-8B


def _jpt(config: str, prompt: int, gen: int, batch: int, policy: str) -> float:
    from dtypelab.forecasting import target_device
    from dtypelab.serving import Shape, serve_forecast

    report = serve_forecast(f"hf:{os.path.join(CONFIGS, config)}", Shape(prompt, gen, batch),
                            target_device("H100", None, None), f"{policy}+compile", search=False, launcher="inline")
    g = report.policies[0].generate
    assert g is not None and g.energy is not None and g.energy.joules_per_token is not None, report.policies[0].reason
    return g.energy.joules_per_token


def fit() -> float:
    """ACTIVITY["memory"] that makes the fitted row's forecast its published figure: joules are linear in it."""
    from dtypelab.core import power

    row = next(r for r in ROWS if r[7])
    kept = dict(power.ACTIVITY)
    try:
        power.ACTIVITY["memory"] = 0.0
        j0 = _jpt(*row[1:6])
        power.ACTIVITY["memory"] = 1.0
        j1 = _jpt(*row[1:6])
    finally:
        power.ACTIVITY.clear()
        power.ACTIVITY.update(kept)
    return (row[6] - j0) / (j1 - j0)


def published() -> str:
    lines = ["| source | model | prompt + generated | batch | policy | published J/token | forecast | error | |",
             "|---|---|---|---|---|---|---|---|---|"]
    held = []
    for source, config, prompt, gen, batch, policy, pub, fitted in ROWS:
        got = _jpt(config, prompt, gen, batch, policy)
        err = got / pub - 1
        held += [] if fitted else [abs(err)]
        lines.append(f"| {source} | {config} | {prompt} + {gen} | {batch} | {policy} | {pub:g} | {got:.3g} | "
                     f"{err:+.0%} | {'fitted' if fitted else 'held out'} |")
    lines += ["", "| source | model | batch | policy | published vs bf16 | forecast vs bf16 | error |",
              "|---|---|---|---|---|---|---|"]
    for source, config, prompt, gen, batch, policy, pub in RATIOS:
        got = _jpt(config, prompt, gen, batch, policy) / _jpt(config, prompt, gen, batch, "bf16")
        held.append(abs(got / pub - 1))
        lines.append(f"| {source} | {config} | {batch} | {policy} | {pub:.2f} | {got:.2f} | {got / pub - 1:+.0%} |")
    lines += ["", "| source | model | batch | fp8 vs bf16, published | forecast | agrees |",
              "|---|---|---|---|---|---|"]
    agree = 0
    for batch, said in DIRECTION:
        ratio = _jpt("llama3.1-8b", 512, 717, batch, "fp8-dyn-row") / _jpt("llama3.1-8b", 512, 717, batch, "bf16")
        got = "more" if ratio > 1 else "less"
        agree += got == said
        lines.append(f"| {MLENERGY} | llama3.1-8b | {batch} | {said} | {ratio:.2f}x ({got}) | "
                     f"{'yes' if got == said else 'no'} |")
    lines.append(f"\nHeld out: the largest error {max(held):.0%}, the median {sorted(held)[len(held) // 2]:.0%}; the "
                 f"fp8-against-bf16 direction agrees at {agree} of {len(DIRECTION)} batch sizes. H100 SXM, compiled "
                 "policies (vLLM runs CUDA graphs). Made by `python benchmarks/energy.py --part published`.\n")
    return "\n".join(lines)


def gpu(results: str = os.path.join(ROOT, "benchmarks", "results")) -> str:
    """Per GPU the GPU check returned records from: the train part's measured joules per step (its rounds, NVML)
    beside the forecast part's (the power model for that GPU; gpt2 is gpt2-full's shape on a GPU, the same batch)."""
    import json

    out = []
    for gpu_dir in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        paths = [os.path.join(results, gpu_dir, f) for f in ("train.json", "forecast.json")]
        if not all(os.path.exists(p) for p in paths):
            continue
        with open(paths[0]) as f, open(paths[1]) as g:
            train, fc = json.load(f), json.load(g)
        forecast = {p["policy"]: p.get("energy") for p in fc.get("policies", [])}
        rows = [f"| {r['policy']} | {m['joules_per_step']:.3g} ({m['low'] or 0:.3g}–{m['high'] or 0:.3g}) | "
                f"{m['watts']:.0f} | {e['joules_per_step']:.3g} | {e['watts']:.0f} | "
                f"{e['joules_per_step'] / m['joules_per_step'] - 1:+.0%} |"
                for r in train.get("results", []) if (m := r.get("energy")) and (e := forecast.get(r["policy"]))]
        why = (train.get("energy_source") or {}).get("why") or "no policy has both"
        out.append(f"{gpu_dir}\n\n| policy | measured J/step (95%) | measured W | forecast J/step | forecast W | "
                   "error |\n|---|---|---|---|---|---|\n" + ("\n".join(rows) if rows else f"| {why} |||||| "))
    return "\n\n".join(out) or "No GPU check has returned both train.json and forecast.json with energy yet."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["published", "fit", "gpu"], required=True)
    args = ap.parse_args()
    if args.part == "gpu":
        print(gpu())
        return
    if args.part == "fit":
        print(f'ACTIVITY["memory"] = {fit():.3f}')
        return
    text = published()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
