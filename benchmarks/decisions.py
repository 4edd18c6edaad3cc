"""Do faster sweeps decide the same? Runs an older commit of dtypelab and the working tree on the same cases, one
after the other, and compares their answers and wall times.

    python benchmarks/decisions.py [--old 64f4910] [--cases digits,charlm,minilm,script] [--out DIR]

The old code runs from a `git worktree` of --old in a temporary folder, imported first through PYTHONPATH in this
same environment; the new code is this checkout's `src/`. Every run gets its own empty inductor cache, so each
compiled policy pays its compilation as a first-time user's would. Per case it prints the wall time of each side,
the recommended policy, and each policy's paired speedup interval; the decisions *agree* when both recommend the
same policy, and each policy's intervals are compared for overlap (intervals that do not overlap mean the two
runs measured a different speed, whichever code is right). Run it alone: nothing else may use the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtypelab import recommend
from dtypelab.core.records import load_report

ROOT = Path(__file__).resolve().parents[1]
# (label, the bench arguments); the script case is the shipped training script, one epoch
CASES = {
    "digits": ["digits"],
    "charlm": ["charlm"],
    "minilm": ["minilm", "--mode", "infer"],
    "script": [str(ROOT / "examples" / "train_loop.py"), "--", "--epochs", "1"],
}


def run(src: Path, args: list[str], out: Path) -> tuple[float, int, str]:
    """One `dtypelab bench` with the package imported from ``src``: (wall seconds, exit code, stderr tail). Its
    progress lines (each with the seconds since the start) go to ``out`` with .log for .json."""
    env = {**os.environ, "PYTHONPATH": str(src), "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-"),
           "DTYPELAB_HEARTBEAT_S": "3600", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "dtypelab", "bench", *args[:1], "--json", str(out), *args[1:]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    out.with_suffix(".log").write_text(proc.stderr)
    return wall, proc.returncode, proc.stderr[-2000:]


def summary(path: Path) -> dict:
    """The decision and every policy's speed evidence, from the record."""
    report = load_report(str(path))
    rec = recommend(report)
    speeds = {}
    for r in report.results:
        if r.speedup_ci:
            speeds[r.policy] = [round(r.speedup_ci.point, 3), round(r.speedup_ci.low, 3), round(r.speedup_ci.high, 3)]
        elif r.status == "ok" and r.policy != "fp32":
            speeds[r.policy] = None  # ran, but no interval (rejected before the rounds, or no rounds)
    statuses = {r.policy: r.status for r in report.results}
    return {"best": rec.best or "fp32", "speeds": speeds, "statuses": statuses}


def compare(old: dict, new: dict) -> tuple[bool, list[str]]:
    """(same decision, the policies whose intervals do not overlap)."""
    apart = []
    for name, a in old["speeds"].items():
        b = new["speeds"].get(name)
        if a and b and (a[2] < b[1] or b[2] < a[1]):
            apart.append(name)
    return old["best"] == new["best"], apart


def fmt(speeds: dict) -> str:
    return "; ".join(f"{k} {v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})" if v else f"{k} -"
                     for k, v in speeds.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="64f4910", help="the commit to compare against")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="keep the records and a summary.json here")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    tmp = Path(tempfile.mkdtemp(prefix="decisions-"))
    out = Path(args.out) if args.out else tmp
    out.mkdir(parents=True, exist_ok=True)
    tree = tmp / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.old],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        for case in cases:
            row: dict = {"case": case}
            for side, src in (("old", tree / "src"), ("new", ROOT / "src")):
                path = out / f"{case}-{side}.json"
                wall, rc, tail = run(src, CASES[case], path)
                row[side] = {"wall_s": round(wall, 1), "exit": rc}
                if path.exists():
                    row[side].update(summary(path))
                else:
                    row[side]["error"] = tail.strip().splitlines()[-1] if tail.strip() else "no record"
                print(f"{case:7s} {side}: {wall:6.1f} s, exit {rc}, best {row[side].get('best', '?')}",
                      flush=True)
            if "best" in row["old"] and "best" in row["new"]:
                row["same_decision"], row["intervals_apart"] = compare(row["old"], row["new"])
            rows.append(row)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (out / "summary.json").write_text(json.dumps({"old": args.old, "rows": rows}, indent=1))
    print("\n| case | old s | new s | old decision | new decision | same | intervals apart |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        o, n = r["old"], r["new"]
        print(f"| {r['case']} | {o['wall_s']} | {n['wall_s']} | {o.get('best', o.get('error'))} | "
              f"{n.get('best', n.get('error'))} | {r.get('same_decision', '?')} | "
              f"{', '.join(r.get('intervals_apart', [])) or '-'} |")
    for r in rows:
        for side in ("old", "new"):
            if "speeds" in r[side]:
                print(f"{r['case']} {side}: {fmt(r[side]['speeds'])}")
    print(f"\nrecords and summary.json in {out}")


if __name__ == "__main__":
    main()
