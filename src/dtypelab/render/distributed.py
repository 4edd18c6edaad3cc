"""The tables of a distributed run (``bench --nproc``): what each policy sent per step and where its time went,
then the scaling estimate, labelled as the estimate it is."""

from __future__ import annotations

from dtypelab.core.results import Report
from dtypelab.core.text import num, size_text
from dtypelab.render.profile import Section

SHOWN_RANKS = (8, 64)


def distributed_sections(report: Report) -> list[Section]:
    ran = [(r, r.distributed) for r in report.results if r.distributed is not None]
    if not ran:
        return []
    base = report.base
    base_wire = base.distributed.wire_bytes if base is not None and base.distributed else None
    d0 = ran[0][1]
    world = d0.nproc * d0.nnodes
    headers = ["policy", "how", "payload/step", "wire/step/rank", f"bytes vs {report.baseline}", "collectives",
               "comm in flight ms", "compute ms (1 rank)", "step ms (slowest)", "peak per rank"]
    rows = []
    for r, d in ran:
        payload = ", ".join(f"{k} {size_text(v)}" for k, v in d.payload_bytes.items()) or "—"
        ratio = f"{d.wire_bytes / base_wire:.3g}x" if base_wire else "—"
        rows.append([r.policy, d.modifier, payload, size_text(d.wire_bytes), ratio, str(d.collectives),
                     num(d.comm_in_flight_s * 1e3, ".3g"), num(d.compute_s * 1e3, ".3g"),
                     num(r.timing.median * 1e3 if r.timing else None, ".3g"),
                     " / ".join(size_text(p) for p in d.rank_peak_bytes) or "—"])
    notes = [
        f"{world} ranks ({d0.nproc} per node × {d0.nnodes} node{'s' if d0.nnodes > 1 else ''}, torchrun, "
        f"{d0.backend}); each rank trains on its 1/{world} slice of the same global batch of "
        f"{report.config.batch_size}; a policy without a modifier runs as plain DDP.",
        "payload: the tensors handed to collectives per step and rank (medians after warm-up; PowerSGD after its "
        "plain all-reduce steps); wire: what a ring algorithm sends per rank for it (2(N−1)/N × an all-reduce, "
        "(N−1)/N × an all-gather or reduce-scatter).",
        "comm in flight: from each collective's issue to its completion, summed (it overlaps the backward pass); "
        "compute: the same step on a one-rank group per rank (hooks and casts, no peer).",
        f"link between these ranks, measured: {d0.link_latency_s * 1e6:.3g} µs per all-reduce, "
        f"{d0.link_gbps:.3g} Gbit/s for a {size_text(d0.link_probe_bytes)} all-reduce.",
    ]
    out = [Section("distributed: bytes, communication and memory per step", headers, rows, notes, left={0, 1, 2})]
    est = report.scaling
    if est is None or not est.points:
        return out
    links = list(dict.fromkeys(p.link for p in est.points))
    cols = [(link, n) for n in SHOWN_RANKS for link in links]
    by = {(p.policy, p.link, p.nproc): p for p in est.points}
    headers = ["policy", "model vs measured", *[f"{link} ×{n}" for link, n in cols], "verdict (estimate)"]
    rows = []
    for policy in dict.fromkeys(p.policy for p in est.points):
        cells = [f"{by[(policy, link, n)].speedup:.2f}x" if (policy, link, n) in by else "—" for link, n in cols]
        err = est.validation.get(policy)
        rows.append([policy, f"{err * 100:+.0f}%" if err is not None else "—", *cells,
                     est.verdicts.get(policy, "baseline")])
    notes = [f"ESTIMATE, not a measurement: speedup vs fp32 DDP at N ranks over each link, from this run's measured "
             f"compute and bytes per step by a {est.model}; a DDP hook's compute is never taken below plain DDP's.",
             f"model vs measured: the model at the {world} measured ranks and the measured link against the measured "
             "step (its error). Presets are nominal per-direction bandwidths: 25gbe 25, 100gbe 100, pcie4 256, "
             "nvlink4 3600 Gbit/s; the JSON record holds every point (2, 8, 64, 512 ranks)."]
    out.append(Section("distributed: scaling estimate (not measured)", headers, rows, notes,
                       left={0, len(headers) - 1}, wrap={len(headers) - 1}))
    return out
