"""Does a change to the judging decide the same? Re-judges stored bench records with an older commit's code and
with the working tree's, and compares every decision, chosen policy, verdict, sentence and table note.

    python benchmarks/rejudge.py [--old COMMIT] PATH [PATH ...]

Each PATH is a bench record (``dtypelab.report``) or a folder searched for them. Unlike ``decisions.py``, nothing is
measured again: the same measurements go through both versions of ``recommend``, so any difference is the code's.
The old code runs from a ``git worktree`` of --old, imported first through PYTHONPATH in this environment.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JUDGE = """
import json, sys
from dtypelab import recommend
from dtypelab.core.records import load_report
out = {}
for f in sys.argv[2:]:
    try:
        rec = recommend(load_report(f))
    except Exception as exc:  # a record this version cannot read: said, not compared
        out[f] = ["unreadable", type(exc).__name__]
        continue
    out[f] = [str(rec.decision), rec.best, list(rec.sentences), list(rec.notes),
              [[v.policy, str(v.verdict), v.text, v.speedup, v.lowest_memory] for v in rec.policies]]
json.dump(out, open(sys.argv[1], "w"))
"""


def records(paths: list[str]) -> list[str]:
    found = []
    for p in map(Path, paths):
        for f in ([p] if p.is_file() else sorted(p.rglob("*.json"))):
            try:
                if json.loads(f.read_text()).get("schema") == "dtypelab.report":
                    found.append(str(f))
            except (ValueError, OSError, AttributeError):
                continue
    return found


def judged(src: Path, files: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, "-c", JUDGE, str(out), *files], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="HEAD~1", help="the commit to compare with (default: the one before)")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    files = records(args.paths)
    if not files:
        print("no bench records found", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dtypelab-rejudge-") as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.old], check=True,
                       capture_output=True)
        try:
            old = judged(tree / "src", files, Path(tmp) / "old.json")
            new = judged(ROOT / "src", files, Path(tmp) / "new.json")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    read = [f for f in files if old[f][0] != "unreadable" and new[f][0] != "unreadable"]
    differ = [f for f in read if old[f] != new[f]]
    decisions: dict[str, int] = {}
    for f in read:
        decisions[new[f][0]] = decisions.get(new[f][0], 0) + 1
    print(f"{len(read)} of {len(files)} bench records judged by both ({args.old} and the working tree); "
          f"decisions: {', '.join(f'{k} {v}' for k, v in sorted(decisions.items()))}")
    for f in differ:
        print(f"DIFFERS: {f}\n  old: {str(old[f])[:300]}\n  new: {str(new[f])[:300]}")
    print("the same decisions, verdicts, sentences and notes" if not differ else f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
