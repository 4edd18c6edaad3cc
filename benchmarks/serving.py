"""Serving: the kernels' shares fitted to published decode tables, the CPU self-check, and how long both commands take.

    python benchmarks/serving.py --part calibrate   # each kernel's bandwidth share, fitted to its published ratio
    python benchmarks/serving.py --part check       # forecast --check on this CPU (tinylm)
    python benchmarks/serving.py --part speed       # wall time: the 8B forecast of six policies, the measured sweep
    python benchmarks/serving.py --part engine      # wall time: --engine vllm, 8B on an H100, 70B at tensor parallel 8
    python benchmarks/serving.py --part quality     # the default measured sweep's time and its 4-bit methods' KL

The published decode tables (gpt-fast's and torchao's READMEs) are the validation set's serve-speed, serve-tok-s and
serve-peak cases (benchmarks/validation/decode-single-stream.json; ``python benchmarks/validate.py`` checks them). The
cases marked fitted there are the ones ``calibrate`` fits a kernel's share to; every other is held out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")
# the format a fitted case names, and the kernel whose share it fits (serving/kernels.py)
KERNEL_OF = {"int8-wo": "int8-weight-only", "int4-wo": "int4-weight-only", "int8-dyn": "int8-dynamic",
             "fp8-wo": "fp8-weight-only", "fp8-dyn-row": "fp8-dynamic-per-channel",
             "fp8-dyn-tensor": "fp8-dynamic-per-tensor"}


def _fitted() -> list[tuple[str, str, str, float]]:
    """(policy, config, device, published ratio to bf16) of each fitted serve-speed case of the validation set."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import validate

    return [(c["value"]["policy"].removesuffix("+compile"), args[0], validate.flag(args, "--device"), c["published"])
            for c, args in validate.fitted("serve-speed")]


def calibrate() -> None:
    """Each kernel's bandwidth share fitted so that the forecast gives its case's published ratio to bf16: a
    memory-bound decode step takes a + b / share, so two forecasts (at the share and at half of it) give a and b."""
    from dataclasses import replace

    from dtypelab.serving import serve_forecast
    from dtypelab.serving.kernels import KERNELS

    def step_s(config: str, device: str, policy: str) -> float:
        report = serve_forecast(config, prompt_len=5, gen_len=200, batch_size=1, device=device,
                                policies=f"{policy}+compile", batch_search=False, launcher="inline")
        return report.policies[0].generate.token_latency_s  # type: ignore[union-attr,return-value]

    for policy, config, device, ratio in _fitted():
        key = KERNEL_OF[policy]
        share = KERNELS[key].share
        t1 = step_s(config, device, policy)
        KERNELS[key] = replace(KERNELS[key], share=share / 2)
        t2 = step_s(config, device, policy)
        KERNELS[key] = replace(KERNELS[key], share=share)
        b = (t2 - t1) * share  # t(s) = a + b / s
        a = t1 - b / share
        target = step_s(config, device, "bf16") / ratio
        print(f"{key}: share {b / (target - a):.4f} (was {share:.4f}; {os.path.basename(config)} on {device})")


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dtypelab", *argv], check=True, cwd=ROOT, capture_output=True)
    return time.perf_counter() - start


ENGINE_GOALS = {"llama3.1-8b": 30.0, "llama3.1-70b": 60.0}  # seconds (issue #78)


def engine() -> None:
    """The vLLM engine's forecast, four formats at 128 concurrent requests: the 8B on one H100, the 70B at tensor
    parallel 8; each against its goal."""
    policies = "bf16,int8-wo,int4-wo,fp8-dyn-row"
    for name, tp in (("llama3.1-8b", "1"), ("llama3.1-70b", "8")):
        took = timed(["forecast", f"hf:{os.path.join(CONFIGS, name)}", "--mode", "generate", "--engine", "vllm",
                      "--device", "H100", "-p", policies, "--tensor-parallel-size", tp, "--prompt-len", "1024",
                      "--gen-len", "512", "-b", "128", "--max-model-len", "32000", "--json", os.devnull])
        goal = ENGINE_GOALS[name]
        print(f"forecast --engine vllm {name}, tensor parallel {tp}, four formats: {took:.1f} s (goal {goal:g} s: "
              f"{'met' if took <= goal else 'MISSED'})")


SWEEP_GOAL_S = 120.0  # the default bench tinylm --mode generate here (issue #79)
FOUR_BIT = ("int4-wo", "w4a16-rtn", "w4a16-gptq", "w4a16-awq")


def quality() -> None:
    """The default measured sweep (every default policy, int4 emulated, GPTQ and AWQ calibrated) against its goal,
    each 4-bit policy's KL from fp32 with its interval, and tune --mode generate's time."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "g.json")
        took = timed(["bench", "tinylm", "--mode", "generate", "--json", path])
        with open(path) as f:
            record = json.load(f)
    print(f"bench tinylm --mode generate ({len(record['policies'])} policies): {took:.1f} s (goal {SWEEP_GOAL_S:g} s: "
          f"{'met' if took <= SWEEP_GOAL_S else 'MISSED'})")
    kl = {}
    for p in record["policies"]:
        q = p.get("quality") or {}
        if p["policy"] in FOUR_BIT and q.get("kl"):
            kl[p["policy"]] = q["kl"]
            print(f"  {p['policy']}: KL {q['kl']['value']:.4g} [{q['kl']['low']:.4g}, {q['kl']['high']:.4g}], "
                  f"perplexity {q['change']['value']:+.2%} [{q['change']['low']:+.2%}, {q['change']['high']:+.2%}]")
    if "w4a16-gptq" in kl and "w4a16-rtn" in kl:
        below = kl["w4a16-gptq"]["high"] < kl["w4a16-rtn"]["low"]
        print(f"GPTQ's KL below round-to-nearest's beyond their intervals: {'yes' if below else 'NO'}")
    took = timed(["tune", "tinylm", "--mode", "generate", "--gpu", "H100", "--kl-budget", "0.004", "--json",
                  os.devnull])
    print(f"tune tinylm --mode generate (16 units x 2 formats): {took:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["calibrate", "check", "speed", "engine", "quality"], required=True)
    args = ap.parse_args()
    if args.part == "quality":
        quality()
    elif args.part == "calibrate":
        calibrate()
    elif args.part == "engine":
        engine()
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
        print(f"bench tinylm --mode generate (the default policies): {took:.1f} s")


if __name__ == "__main__":
    main()
