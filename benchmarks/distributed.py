"""Distributed policies side by side on 2 ranks: bytes per step against fp32 DDP, where the step's time goes, and
the scaling model's error on the run it was built from.

    python benchmarks/distributed.py [--tasks digits,charlm] [--nproc 2] [--policies ...]

Runs ``dtypelab.bench(task, nproc=N)`` (each policy under torchrun, gloo on this CPU) and prints one line per policy:
step time (slowest rank) and speedup vs fp32 DDP, payload and wire bytes per step and their ratio to fp32's,
collectives, communication in flight, one-rank compute, the model's error at the measured point, the metric, and
the estimate's verdict. Never run it beside another torch process: two of them on 2 cores slow each other 10-30x.
"""

from __future__ import annotations

import argparse

import dtypelab
from dtypelab.core.judging import recommend

MB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--policies", default=None)
    args = ap.parse_args()
    hw = dtypelab.probe(budget_s=0.02)
    print(f"{hw.cpu_name}; flags {' '.join(hw.cpu_flags)}")
    for task in args.tasks.split(","):
        report = dtypelab.bench(task, args.policies, nproc=args.nproc, budget=0)
        base = report.result("fp32")
        rec = recommend(report)
        fp32_wire = base.distributed.wire_bytes if base and base.distributed else None
        print(f"\n{task}: {args.nproc} ranks, batch {report.config.batch_size}, {report.config.steps} steps; "
              f"metric {report.config.metric}")
        print(f"{'policy':36} {'step ms':>8} {'speedup':>8} {'payload MB':>11} {'wire/fp32':>9} {'coll':>5} "
              f"{'comm ms':>8} {'compute ms':>10} {'model err':>9} {'metric':>8}  verdict")
        for r in report.results:
            d = r.distributed
            if d is None or not r.timing:
                print(f"{r.policy:36} {r.status}: {r.reason[:120]}")
                continue
            err = report.scaling.validation.get(r.policy) if report.scaling else None
            print(f"{r.policy:36} {r.timing.median * 1e3:8.3g} {base.timing.median / r.timing.median:7.2f}x "
                  f"{sum(d.payload_bytes.values()) / MB:11.3g} {d.wire_bytes / fp32_wire:8.3g}x {d.collectives:5d} "
                  f"{d.comm_in_flight_s * 1e3:8.3g} {d.compute_s * 1e3:10.3g} "
                  f"{(f'{err * 100:+.0f}%' if err is not None else '—'):>9} {r.metric(report.config.metric):8.4g}  "
                  f"{rec.verdicts.get(r.policy, '')}")
        if report.scaling:
            for policy, verdict in report.scaling.verdicts.items():
                print(f"  estimate, {policy}: {verdict}")
        d = base.distributed
        print(f"  link measured: {d.link_latency_s * 1e6:.3g} µs per all-reduce, {d.link_gbps:.3g} Gbit/s")


if __name__ == "__main__":
    main()
