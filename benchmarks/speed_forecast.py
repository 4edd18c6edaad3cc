"""Will it be faster, checked: the forecast's predicted speedups against measured ones.

    python benchmarks/speed_forecast.py [--part cpu,published,far] [--out DIR]

cpu: for digits, charlm, gpt2 (reduced) and the small decoder, each policy's predicted speedup vs fp32 on this CPU
    (``forecast TASK --device cpu``: the time model with the probe's measured rates) beside bench's measured paired
    speedup and its 95% interval (``bench TASK``, interleaved rounds), in separate processes, one after the other.
    Reported: the ratio predicted/measured, whether it is within 20%, and whether the ranking agrees where bench's
    intervals separate.
published: the cases under benchmarks/speed_cases/ (published end-to-end measurements, each a task file rebuilding
    the model's shape with its conditions and source): the predicted ratio between two policies on the named GPU
    beside the published one.
far: a 7B shape (llama2-7b) with six policies on an H100, timed as a user runs it (the goal: under 60 s).

Run it alone: nothing else may use the CPU. Say which CPU (``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "benchmarks" / "speed_cases"
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


def _seconds(fc, name: str, left_out: list[str]) -> float | None:
    """A policy's predicted step, less the groups of ops the published measurement did not time."""
    t = fc.result(name).time
    if t is None or not t.step_s:
        return None
    return t.step_s - sum(t.breakdown.get(g, 0.0) for g in left_out)


def _forecast(case: dict, stem: str, policies: list[str], batch: int | None, out: Path):
    """The case's forecast of ``policies`` at ``batch`` (the task's own when None); None when it failed."""
    fc_json = out / f"{stem}-b{batch or 'task'}-forecast.json"
    task_file, _, factory = case["task"].partition(":")
    args = ["forecast", f"{CASES / task_file}:{factory or 'make_task'}", "-p", ",".join(policies), "--device",
            case["device"], "--no-batch-search", "--json", str(fc_json)]
    if case["baseline"] in policies:
        args += ["--baseline", case["baseline"]]
    done = dtypelab(*args, *(["-b", str(batch)] if batch else []))
    if done.returncode != 0:
        print(f"{stem}: forecast failed: {done.stderr[-800:]}", file=sys.stderr)
        return None
    from dtypelab.core.records import load_record

    return load_record(str(fc_json))


def _throughputs(case: dict, stem: str, out: Path) -> dict[str, float | None]:
    """Samples a second per policy, predicted: each policy at its own batch where the published runs differed
    ("batches": the largest that fitted each, as Lambda's benchmark runs them), else at the case's "batch"."""
    policies = [case["baseline"], *case["ratios"]]
    batches = case.get("batches") or dict.fromkeys(policies, case.get("batch"))
    left_out = case.get("exclude", [])  # groups the published measurement did not time (an optimizer step)
    rates: dict[str, float | None] = {}
    for batch in sorted(set(batches.values()), key=lambda b: b or 0):
        group = [p for p in policies if batches[p] == batch]
        fc = _forecast(case, stem, group, batch, out)
        for policy in group:
            seconds = _seconds(fc, policy, left_out) if fc is not None else None
            rates[policy] = (batch or fc.result(policy).train.batch_size) / seconds if seconds else None
    return rates


def published(out: Path) -> list[dict]:
    rows = []
    for case_file in sorted(CASES.glob("*.json")):
        case = json.loads(case_file.read_text())
        start = time.monotonic()
        rates = _throughputs(case, case_file.stem, out)
        base = rates[case["baseline"]]
        for policy, ratio in case["ratios"].items():
            mine = rates[policy]
            predicted = mine / base if base and mine else None
            rows.append({"case": case_file.stem, "device": case["device"], "policy": policy, "published": ratio,
                         "predicted": predicted, "ratio": predicted / ratio if predicted else None,
                         "seconds": time.monotonic() - start, "source": case["source"]})
    return rows


def far(out: Path) -> dict:
    start = time.monotonic()
    done = dtypelab("forecast", "llama2-7b", "-p", FAR, "--device", "H100", "--no-batch-search", "--json",
                    str(out / "llama2-7b-forecast.json"))
    return {"seconds": time.monotonic() - start, "ok": done.returncode == 0, "stderr": done.stderr[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="cpu,published,far")
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
    if "published" in parts:
        rows = published(out)
        print("\npublished: predicted ratio against the published one")
        for r in rows:
            pred = f"{r['predicted']:.2f}x" if r["predicted"] else "—"
            ratio = f"{r['ratio']:.2f}" if r["ratio"] else "—"
            print(f"  {r['case']} ({r['device']}): {r['policy']} predicted {pred}, published {r['published']:.2f}x, "
                  f"predicted/published {ratio}, {r['seconds']:.0f} s ({r['source']})")
        errors = sorted(abs(r["ratio"] - 1) for r in rows if r["ratio"])
        if errors:
            print(f"  {len(errors)} of {len(rows)} predicted; within 15%: {sum(e <= 0.15 for e in errors)}, "
                  f"within 20%: {sum(e <= 0.20 for e in errors)}; median error {errors[len(errors) // 2]:.0%}, "
                  f"largest {errors[-1]:.0%}")
    if "far" in parts:
        f = far(out)
        print(f"\nfar: llama2-7b, {len(FAR.split(','))} policies on an H100: {f['seconds']:.0f} s "
              f"({'ok' if f['ok'] else 'FAILED: ' + f['stderr']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
