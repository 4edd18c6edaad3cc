"""Serving: the forecast against published decode measurements, the CPU self-check, and how long both commands take.

    python benchmarks/serving.py --part published   # writes docs/samples/serving-published.md
    python benchmarks/serving.py --part calibrate   # each kernel's bandwidth share, fitted to its table
    python benchmarks/serving.py --part check       # forecast --check on this CPU (tinylm)
    python benchmarks/serving.py --part speed       # wall time: the 8B forecast of six policies, the measured sweep

The published tables (single stream: batch 1, a short prompt, torch.compile):

- gpt-fast's README (pytorch-labs/gpt-fast, README.md at 0f925b5): Llama-2-7B on an A100-80GB power-limited to
  330 W, a 5-token prompt: bf16 104.9 tok/s, int8 weight-only 155.58, int4 weight-only (groups of 32) 196.80;
- torchao's quantization README (pytorch/ao, torchao/quantization/README.md), A100-80GB, Llama-3-8B: bf16 95.64,
  int8wo 153.03, int4wo-64 180.80, int8dq 8.61;
- the same README, H100, Llama-3.1-8B: bf16 126.90, int8wo 198.85, int4wo-64 241.39, float8wo 178.46, float8dq
  per-tensor 116.40, per-row 154.63.

The kernels' bandwidth shares (src/dtypelab/serving/kernels.py) came from the first table (int8, int4) and the third
(fp8 weight-only and dynamic) and the second (int8 dynamic): those rows check the model's structure, not its shares.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")
OUT = os.path.join(ROOT, "docs", "samples", "serving-published.md")

GPT_FAST = "gpt-fast README"
TORCHAO = "torchao quantization README"
# (source, config, device, {policy: published tok/s}, the policies whose share came from this source)
TABLES = (
    (GPT_FAST, "llama2-7b", "A100-80GB", {"bf16": 104.9, "int8-wo": 155.58, "int4-wo": 196.80},
     {"int8-wo", "int4-wo"}),
    (TORCHAO, "llama3-8b", "A100-80GB", {"bf16": 95.64, "int8-wo": 153.03, "int4-wo": 180.80, "int8-dyn": 8.61},
     {"int8-dyn"}),
    (TORCHAO, "llama3.1-8b", "H100", {"bf16": 126.90, "int8-wo": 198.85, "int4-wo": 241.39, "fp8-wo": 178.46,
                                       "fp8-dyn-tensor": 116.40, "fp8-dyn-row": 154.63},
     {"fp8-wo", "fp8-dyn-tensor", "fp8-dyn-row"}),
)
NOTES = {GPT_FAST: "int4 in groups of 32 there, 128 here; 330 W power limit",
         TORCHAO: "int4 in groups of 64 there, 128 here"}


def published() -> str:
    from dtypelab.forecasting import target_device
    from dtypelab.serving import Shape, serve_forecast

    rows, worst, order_ok = [], 0.0, True
    for source, config, device, table, fitted in TABLES:
        names = ",".join(f"{p}+compile" for p in table)
        report = serve_forecast(f"hf:{os.path.join(CONFIGS, config)}", Shape(5, 200, 1),
                                target_device(device, None, None), names, search=False, launcher="inline")
        got = {p: report.result(f"{p}+compile").generate.decode_tok_s for p in table}  # type: ignore[union-attr]
        base_pub, base_got = table["bf16"], got["bf16"]
        order_ok &= sorted(table, key=table.__getitem__) == sorted(got, key=lambda p: got[p] or 0.0)
        for p, pub in table.items():
            ratio_pub, ratio_got = pub / base_pub, (got[p] or 0.0) / base_got
            err = ratio_got / ratio_pub - 1
            held = p != "bf16" and p not in fitted
            if held:
                worst = max(worst, abs(err))
            rows.append(f"| {source} | {config} | {device} | {p} | {pub:g} | {got[p]:.1f} | {got[p] / pub - 1:+.0%} | "
                        f"{ratio_pub:.3f} | {ratio_got:.3f} | {err:+.1%} | "
                        f"{'held out' if held else 'share fitted here' if p != 'bf16' else 'baseline'} |")
    head = ("| source | model | GPU | format | published tok/s | forecast | error | published vs bf16 | forecast vs "
            "bf16 | ratio error | |\n|---|---|---|---|---|---|---|---|---|---|---|")
    notes = "; ".join(f"{k}: {v}" for k, v in NOTES.items())
    ranked = "in the published order" if order_ok else "NOT in the published order"
    summary = (f"\nHeld-out ratios: the largest error {worst:.1%}; the formats ranked {ranked} "
               f"in every table. Batch 1, a 5-token prompt, 200 tokens generated, compiled ({notes}). Made by "
               "`python benchmarks/serving.py --part published`.\n")
    return head + "\n" + "\n".join(rows) + "\n" + summary


# (format, the kernel key, the table whose ratio to bf16 fits its share)
FITS = (("int8-wo", "int8-weight-only", 0), ("int4-wo", "int4-weight-only", 0), ("int8-dyn", "int8-dynamic", 1),
        ("fp8-wo", "fp8-weight-only", 2), ("fp8-dyn-row", "fp8-dynamic-per-channel", 2),
        ("fp8-dyn-tensor", "fp8-dynamic-per-tensor", 2))


def calibrate() -> None:
    """Each kernel's bandwidth share fitted so that the forecast gives its table's published ratio to bf16: a
    memory-bound decode step takes a + b / share, so two forecasts (at the share and at half of it) give a and b."""
    from dataclasses import replace

    from dtypelab.forecasting import target_device
    from dtypelab.serving import Shape, serve_forecast
    from dtypelab.serving.kernels import KERNELS

    def step_s(table: tuple, policy: str) -> float:
        _, config, device, _, _ = table
        report = serve_forecast(f"hf:{os.path.join(CONFIGS, config)}", Shape(5, 200, 1),
                                target_device(device, None, None), f"{policy}+compile", search=False,
                                launcher="inline")
        return report.policies[0].generate.token_latency_s  # type: ignore[union-attr,return-value]

    bf16 = {i: step_s(TABLES[i], "bf16") for i in {t for _, _, t in FITS}}
    for policy, key, i in FITS:
        share = KERNELS[key].share
        t1 = step_s(TABLES[i], policy)
        KERNELS[key] = replace(KERNELS[key], share=share / 2)
        t2 = step_s(TABLES[i], policy)
        KERNELS[key] = replace(KERNELS[key], share=share)
        b = (t2 - t1) * share  # t(s) = a + b / s
        a = t1 - b / share
        target = bf16[i] * TABLES[i][3]["bf16"] / TABLES[i][3][policy]
        print(f"{key}: share {b / (target - a):.4f} (was {share:.4f}; {TABLES[i][0]}, {TABLES[i][1]})")


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dtypelab", *argv], check=True, cwd=ROOT, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["published", "calibrate", "check", "speed"], required=True)
    args = ap.parse_args()
    if args.part == "published":
        text = published()
        with open(OUT, "w") as f:
            f.write(text)
        print(text)
    elif args.part == "calibrate":
        calibrate()
    elif args.part == "check":
        out = subprocess.run([sys.executable, "-m", "dtypelab", "forecast", "tinylm", "--mode", "generate", "--device",
                              "cpu", "--check", "-b", "4", "--prompt-len", "64", "--gen-len", "32",
                              "--no-batch-search", "--json", "/tmp/serving-check.json"], cwd=ROOT, text=True,
                             capture_output=True, env={**os.environ, "COLUMNS": "200"})
        print(out.stdout)
    else:
        config = f"hf:{os.path.join(CONFIGS, 'llama3-8b')}"
        common = ["--mode", "generate", "--prompt-len", "512", "--gen-len", "128", "-b", "16", "--json", os.devnull]
        for device in ("H100", "RTX4090"):
            took = timed(["forecast", config, "--device", device, *common])
            print(f"forecast 8B, six policies, {device}: {took:.1f} s")
        print(f"forecast 8B, six policies, RTX4090, --no-batch-search: "
              f"{timed(['forecast', config, '--device', 'RTX4090', '--no-batch-search', *common]):.1f} s")
        took = timed(["bench", "tinylm", "--mode", "generate", "-b", "4", "--prompt-len", "64", "--gen-len", "32",
                      "--json", os.devnull])
        print(f"bench tinylm --mode generate (nine policies): {took:.1f} s")


if __name__ == "__main__":
    main()
