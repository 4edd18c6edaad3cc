"""The scaling estimate: from what each distributed policy measured (its step's compute on a one-rank group, the
payload of each collective per step, their count) a ring all-reduce model predicts the step at N ranks over a link
of B Gbit/s. It is an estimate, labelled so everywhere; it is checked against the run it came from.

    step(N, B) = compute + collectives × α + Σ_kind wire_factor(kind, N) × payload_kind × 8 / B

with no overlap of communication and computation (DDP overlaps the all-reduce with the backward pass, so the
model errs high where communication is a large share: the validation error says by how much). α is the measured
time of a 4-byte all-reduce between the measured ranks (the collective's fixed cost, kept as measured; the
median over the policies' runs, since it belongs to the link and not to a policy). A DDP
hook only adds work to the step it compresses, so a hook policy's compute is never taken below the plain DDP
policy's of the same numerics: a lower figure is timing noise, and crediting it would make any compression "pay".

Link presets are nominal per-direction figures from the specifications (not measurements): PCIe 4.0 x16 32 GB/s,
NVLink 4 (H100 SXM) 450 GB/s, 25 and 100 Gigabit Ethernet.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results import PolicyResult, Report, ScalingEstimate, ScalingPoint
from dtypelab.core.tolerance import BASELINE, Tolerance, judge
from dtypelab.distributed.collectives import wire_factor

LINKS = {"pcie4": 256.0, "nvlink4": 3600.0, "25gbe": 25.0, "100gbe": 100.0}  # Gbit/s, nominal
DEFAULT_LINKS = ("25gbe", "100gbe", "pcie4", "nvlink4")
RANKS = (2, 8, 64, 512)
MIN_GAIN = 0.02  # an estimated speedup below 1.02x is no reason to change anything
MODEL = ("ring all-reduce, no overlap: step(N, B) = compute + collectives × α + Σ wire_factor(N) × payload × 8 / B, "
         "α the measured 4-byte all-reduce (median over the runs)")


def parse_links(spec: str | Sequence[str | float] | None) -> tuple[tuple[str, float], ...]:
    """'25gbe,100gbe,40' -> ((name, Gbit/s), ...): presets by name, other numbers as Gbit/s."""
    items = DEFAULT_LINKS if not spec else ([s.strip() for s in spec.split(",") if s.strip()]
                                            if isinstance(spec, str) else list(spec))
    out = []
    for item in items:
        key = str(item).lower()
        if key in LINKS:
            out.append((key, LINKS[key]))
            continue
        try:
            gbps = float(key)
        except ValueError:
            raise DtypelabError(f"--link-gbps: {item!r} is neither a number of Gbit/s nor a preset "
                                f"({', '.join(LINKS)})") from None
        if not gbps > 0:
            raise DtypelabError(f"--link-gbps must be positive, got {item}")
        out.append((f"{gbps:g} Gbit/s", gbps))
    return tuple(out)


def _same_numerics(r: PolicyResult, base: PolicyResult) -> bool:
    a, b = (x.info.plan if x.info else {} for x in (r, base))
    return all(a.get(k) == b.get(k) for k in ("default", "rules", "compile"))


def compute_of(r: PolicyResult, base: PolicyResult | None) -> float:
    """The compute the model starts from: measured, but for a DDP hook never below plain DDP's of the same
    numerics (a hook adds casts or low-rank work; it cannot remove any)."""
    d = r.distributed
    if base is None or base.distributed is None or d.strategy != "ddp" or base.distributed.strategy != "ddp" \
            or not _same_numerics(r, base):
        return d.compute_s
    return max(d.compute_s, base.distributed.compute_s)


def _wire(r: PolicyResult, n: int) -> float:
    return sum(wire_factor(kind, n) * b for kind, b in r.distributed.payload_bytes.items())


def predict(r: PolicyResult, n: int, gbps: float, base: PolicyResult | None = None,
            alpha: float | None = None) -> float:
    """The model's step time for ``r``'s policy at ``n`` ranks over ``gbps``, with a collective's fixed cost
    ``alpha`` (None: the one measured in ``r``'s own run)."""
    d = r.distributed
    alpha = d.link_latency_s if alpha is None else alpha
    wire = _wire(r, n)  # nothing crosses a link on one rank, which also has no link bandwidth to measure (0)
    return compute_of(r, base) + d.collectives * alpha + (wire * 8 / (gbps * 1e9) if wire else 0.0)


def _verdict(r: PolicyResult, base: PolicyResult, points: list[ScalingPoint], accepted: bool) -> str:
    if not accepted:
        return "not worth it: its metric is outside the tolerance in the measured run"
    wins = [p for p in points if p.policy == r.policy and p.speedup >= 1 + MIN_GAIN]
    if not wins:
        top = max((p for p in points if p.policy == r.policy), key=lambda p: p.speedup)
        saved = (_wire(base, top.nproc) - _wire(r, top.nproc)) * 8 / (top.gbps * 1e9)
        extra = compute_of(r, base) - base.distributed.compute_s
        calls = r.distributed.collectives - base.distributed.collectives
        return (f"not worth it: at best {top.speedup:.3f}x ({top.nproc} ranks, {top.link}), under "
                f"{1 + MIN_GAIN:g}x; there its payload {'saves' if saved >= 0 else 'adds'} {abs(saved) * 1e3:.3g} ms "
                "per step against "
                f"{extra * 1e3:+.3g} ms of compute and {calls:+d} collectives vs fp32, in a step of "
                f"{top.step_s * 1e3:.3g} ms")
    first = min(wins, key=lambda p: (p.nproc, -p.gbps))
    fastest = max(p.gbps for p in wins if p.nproc == first.nproc)
    return (f"estimated to pay from {first.nproc} ranks on links up to {fastest:g} Gbit/s "
            f"({max(wins, key=lambda p: p.speedup).speedup:.2f}x at best)")


def estimate(report: Report, links: Sequence[tuple[str, float]], accepted: dict[str, bool]) -> ScalingEstimate | None:
    """The estimate for every distributed policy that ran, against the baseline's (None: the baseline did not)."""
    ran = [r for r in report.results if r.status == "ok" and r.distributed is not None and r.timing]
    base = next((r for r in ran if r.policy == BASELINE), None)
    if base is None:
        return None
    # α is the link's, not the policy's: one figure (the median of every run's probe) for every policy, or
    # a policy whose probe happened to run quieter would be credited with a faster link
    alpha = statistics.median(r.distributed.link_latency_s for r in ran)
    points, validation = [], {}
    for r in ran:
        d = r.distributed
        # validated on its own measured compute and link: the clamp and the shared α are for comparing policies,
        # not for fitting the run
        validation[r.policy] = predict(r, d.nproc * d.nnodes, d.link_gbps) / r.timing.median - 1
        for name, gbps in links:
            for n in RANKS:
                step = predict(r, n, gbps, base, alpha)
                points.append(ScalingPoint(r.policy, name, gbps, n, step, predict(base, n, gbps, alpha=alpha) / step))
    verdicts = {r.policy: _verdict(r, base, points, accepted.get(r.policy, True)) for r in ran if r is not base}
    return ScalingEstimate(MODEL, tuple(points), validation, verdicts)


def with_scaling(report: Report, links: Sequence[tuple[str, float]]) -> Report:
    """The report with its scaling estimate; a policy whose metric failed the tolerance is "not worth it"."""
    cfg, base = report.config, report.result(BASELINE)
    base_metric = base.metric(cfg.metric) if base is not None else None
    tol = Tolerance.parse(cfg.tolerance)
    accepted = {r.policy: base_metric is None or r.metric(cfg.metric) is None
                or judge(r.metric(cfg.metric), base_metric, tol, cfg.higher_is_better)[0] for r in report.results}
    return replace(report, scaling=estimate(report, links, accepted))
