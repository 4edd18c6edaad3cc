"""Will it be faster, checked: the forecast's predicted speedups against measured ones.

    python benchmarks/speed_forecast.py [--part cpu,far] [--out DIR]

cpu: for digits, charlm, gpt2 (reduced) and the small decoder, each policy's predicted speedup vs fp32 on this CPU
    (``forecast TASK --device cpu``: the time model with the probe's measured rates) beside bench's measured paired
    speedup and its 95% interval (``bench TASK``, interleaved rounds), in separate processes, one after the other.
    Reported: the ratio predicted/measured, whether it is within 20%, and whether the ranking agrees where bench's
    intervals separate.
(The published GPU comparisons are the validation set's train-speed cases: ``python benchmarks/validate.py``.)
far: a 7B shape (llama2-7b) with six policies on an H100, timed as a user runs it (the goal: under 60 s).

Run it alone: nothing else may use the CPU. Say which CPU (``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TASKS = ("digits", "charlm", "gpt2", "decoder")
CPU_POLICIES = "fp32,bf16,amp-bf16,fp16"
FAR = "fp32,tf32,bf16,amp-bf16,amp-bf16+compile,fp8-tensorwise"


def dtypelab(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtypelab", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"}, cwd=ROOT)


def cpu(out: Path, reuse: bool) -> list[dict]:
    """Each task's bench and forecast (kept records with --reuse); a row per policy bench timed against fp32."""
    from dtypelab.core.records import load_record

    rows = []
    for task in CPU_TASKS:
        bench_json, fc_json = out / f"{task}-bench.json", out / f"{task}-forecast.json"
        if not (reuse and bench_json.exists()):
            done = dtypelab("bench", task, "-p", CPU_POLICIES, "--force", "--json", str(bench_json))
            if not bench_json.exists():
                print(f"{task}: bench failed: {done.stderr[-500:]}", file=sys.stderr)
                continue
        if not (reuse and fc_json.exists()):
            done = dtypelab("forecast", task, "-p", CPU_POLICIES, "--device", "cpu", "--no-batch-search", "--json",
                            str(fc_json))
            if done.returncode != 0:
                print(f"{task}: forecast failed: {done.stderr[-500:]}", file=sys.stderr)
                continue
        bench, fc = load_record(str(bench_json)), load_record(str(fc_json))
        verdicts = {v.policy: v for v in bench.recommendation.policies} if bench.recommendation else {}
        for p in fc.policies:
            r, v = bench.result(p.policy), verdicts.get(p.policy)
            if p.policy == "fp32" or r is None or r.status != "ok" or p.time is None or not p.time.speedup:
                continue
            # the paired rounds' speedup and interval where bench timed it in rounds (a policy within tolerance);
            # else its run's median step against fp32's: a point without an interval, left out of the ranking
            ci = r.speedup_ci
            measured = ci.point if ci else (v.speedup if v is not None else None)
            if not measured:
                continue
            ratio = p.time.speedup / measured
            rows.append({"task": task, "policy": p.policy, "predicted": p.time.speedup, "measured": measured,
                         "low": ci.low if ci else None, "high": ci.high if ci else None, "ratio": ratio,
                         "within_20": abs(ratio - 1) <= 0.2, "bound": p.time.bound})
    return rows


def ranking(rows: list[dict]) -> list[str]:
    """Pairs of policies (per task) whose measured intervals separate, and whether the prediction orders them alike."""
    out = []
    for task in {r["task"] for r in rows}:
        mine = [r for r in rows if r["task"] == task]
        mine = [r for r in mine if r["low"] is not None]
        for i, a in enumerate(mine):
            for b in mine[i + 1:]:
                if a["low"] > b["high"] or b["low"] > a["high"]:
                    agree = (a["measured"] > b["measured"]) == (a["predicted"] > b["predicted"])
                    out.append(f"{task}: {a['policy']} vs {b['policy']}: {'same order' if agree else 'REVERSED'}")
    return sorted(out)


def far(out: Path) -> dict:
    start = time.monotonic()
    done = dtypelab("forecast", "llama2-7b", "-p", FAR, "--device", "H100", "--no-batch-search", "--json",
                    str(out / "llama2-7b-forecast.json"))
    return {"seconds": time.monotonic() - start, "ok": done.returncode == 0, "stderr": done.stderr[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="cpu,far")
    ap.add_argument("--out", default=str(ROOT / "dtypelab-results" / "speed-forecast"))
    ap.add_argument("--reuse", action="store_true", help="read the records an earlier run left in --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.part.split(","))
    hw = dtypelab("hardware").stdout.splitlines()[:2]
    print("\n".join(hw))
    if "cpu" in parts:
        rows = cpu(out, args.reuse)
        print("\ncpu: predicted speedup vs fp32 beside bench's paired speedup (95% interval)")
        for r in rows:
            interval = f"[{r['low']:.2f}, {r['high']:.2f}]" if r["low"] is not None else "(one run's medians)"
            print(f"  {r['task']:8s} {r['policy']:9s} predicted {r['predicted']:.2f}x  measured {r['measured']:.2f}x "
                  f"{interval}  predicted/measured {r['ratio']:.2f}"
                  f"{'' if r['within_20'] else '  OUTSIDE 20%'}  ({r['bound']}-bound)")
        if rows:
            errors = sorted(abs(r["ratio"] - 1) for r in rows)
            print(f"  within 20%: {sum(r['within_20'] for r in rows)} of {len(rows)}; median error "
                  f"{errors[len(errors) // 2]:.0%}, largest {errors[-1]:.0%}")
        for line in ranking(rows):
            print("  " + line)
    if "far" in parts:
        f = far(out)
        print(f"\nfar: llama2-7b, {len(FAR.split(','))} policies on an H100: {f['seconds']:.0f} s "
              f"({'ok' if f['ok'] else 'FAILED: ' + f['stderr']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
