"""Lines per second of `dtypelab lint` (goal: >= 5,000), on a large real corpus: by default PyTorch's own
Python source as installed (about 1.2 M lines in 2,300 files), or any directories given.

    python benchmarks/lint_speed.py [PATH ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics

import torch

from dtypelab.lint import lint_paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[os.path.dirname(torch.__file__)])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rates, report = [], None
    for _ in range(args.repeat):
        report = lint_paths(args.paths)
        rates.append(report.lines / report.seconds)
    counts = collections.Counter(f.code for f in report.findings)
    print(f"{report.files:,} files, {report.lines:,} lines: median {statistics.median(rates):,.0f} lines/s "
          f"(runs: {', '.join(f'{r:,.0f}' for r in rates)}); findings {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
