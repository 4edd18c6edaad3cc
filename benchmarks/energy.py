"""Energy: the one activity the power model fits, and a lent GPU's measured joules beside the forecast's.

    python benchmarks/energy.py --part fit         # ACTIVITY["memory"] that makes the fitted case exact
    python benchmarks/energy.py --part gpu         # a lent GPU's measured joules beside the forecast's (GPU check)

The published energy measurements (the "Alice" benchmark, ML.ENERGY's leaderboard v3) are the validation set's energy
cases (benchmarks/validation/energy-serving.json; ``python benchmarks/validate.py`` checks them). The one marked fitted
(Mistral-7B, batch 1, bf16 on an H100) is what ``fit`` fits ``ACTIVITY["memory"]`` to; every other is held out.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fitted_case() -> tuple[tuple[str, int, int, int, str], float]:
    """((config, prompt, generated, batch, policy), published J per token) of the validation set's fitted energy
    case."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import validate

    c, args = validate.fitted("energy")[0]
    shape = (int(validate.flag(args, f)) for f in ("--prompt-len", "--gen-len", "-b"))
    return (args[0], *shape, c["value"]["policy"]), c["published"]


def _jpt(spec: str, prompt: int, gen: int, batch: int, policy: str) -> float:
    from dtypelab.serving import serve_forecast

    report = serve_forecast(spec, prompt_len=prompt, gen_len=gen, batch_size=batch, device="H100", policies=policy,
                            batch_search=False, launcher="inline")
    g = report.policies[0].generate
    assert g is not None and g.energy is not None and g.energy.joules_per_token is not None, report.policies[0].reason
    return g.energy.joules_per_token


def fit() -> float:
    """ACTIVITY["memory"] that makes the fitted case's forecast its published figure: joules are linear in it."""
    from dtypelab.core.machine import power

    row, published = _fitted_case()
    kept = dict(power.ACTIVITY)
    try:
        power.ACTIVITY["memory"] = 0.0
        j0 = _jpt(*row)
        power.ACTIVITY["memory"] = 1.0
        j1 = _jpt(*row)
    finally:
        power.ACTIVITY.clear()
        power.ACTIVITY.update(kept)
    return (published - j0) / (j1 - j0)


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
    ap.add_argument("--part", choices=["fit", "gpu"], required=True)
    args = ap.parse_args()
    if args.part == "gpu":
        print(gpu())
    else:
        print(f'ACTIVITY["memory"] = {fit():.3f}')


if __name__ == "__main__":
    main()
