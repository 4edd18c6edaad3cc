"""The --profile tables: where each policy's step goes, and its slowest ops. Reads records only."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtypelab.core.results import CATEGORIES, CATEGORY_LABELS, PHASES, PolicyResult, ProfileSummary, Report
from dtypelab.core.text import num

TOP_SHOWN = 6  # ops per policy in the tables (the record keeps more)


@dataclass(frozen=True)
class Section:
    """One more table under the main one: title, headers, rows, notes, and which columns read left / wrap."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]
    left: set[int] = field(default_factory=set)
    wrap: set[int] = field(default_factory=set)
    drop: tuple[str, ...] = ()  # header prefixes a narrow terminal leaves out first (default: from the right)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _profiled(report: Report) -> list[tuple[PolicyResult, ProfileSummary]]:
    return [(r, r.profile) for r in report.results if r.profile is not None]


def breakdown_section(report: Report) -> Section | None:
    rows_in = _profiled(report)
    if not rows_in:
        return None
    phases = [p for p in PHASES if any(prof.phases.get(p) for _, prof in rows_in)]
    rated = any(prof.mfu is not None for _, prof in rows_in)
    headers = ["policy", "step ms (profiled)", "profiler cost", *phases,
               *(CATEGORY_LABELS[c] for c in CATEGORIES), "GFLOP/s", "of peak", *(["MFU"] if rated else []), "bound"]
    rows, notes = [], []
    for r, p in rows_in:
        if p.error:
            rows.append([r.policy, "—", "—", *("—" for _ in phases), *("—" for _ in CATEGORIES), "—", "—",
                         *(["—"] if rated else []), "no profile"])
            notes.append(f"{r.policy}: no profile — {p.error}")
            continue
        gflops = p.matmul_flops / p.categories["matmul"] / 1e9 if p.categories.get("matmul") else None
        rows.append([r.policy, num(p.step_s * 1e3, ".3g"), f"{p.overhead:+.0%}" if p.overhead is not None else "—",
                     *(_pct(p.share(p.phases.get(ph, 0.0))) for ph in phases),
                     *(_pct(p.share(p.categories.get(c, 0.0))) for c in CATEGORIES),
                     num(gflops, ".3g"), _pct(p.utilisation), *([_pct(p.mfu)] if rated else []), p.bound])
        notes += _policy_notes(r.policy, p)
    first = rows_in[0][1]
    notes.append(f"{first.steps} profiled steps per policy after its measurement (torch.profiler); shares are of a "
                 f"profiled step. {'CPU op time on the calling thread' if first.device == 'cpu' else 'GPU kernel time'}"
                 "; 'outside ops' is the rest of the step (Python, autograd, optimizer loop"
                 + (", GPU idle" if first.device == "cuda" else "") + "). Profiler cost: a profiled step's time "
                 "over the measured median, never part of the table above.")
    notes.append("GFLOP/s: matmul/conv FLOPs (torch.utils.flop_counter formulas) over their time; of peak: against "
                 "the hardware probe's measured GFLOP/s for each op's dtype.")
    if rated:
        used = ", ".join(f"{r.policy} {p.mfu_key} {p.rated_tflops:g}" for r, p in rows_in if p.mfu is not None)
        notes.append("MFU: the step's matmul/conv FLOPs over its unprofiled median time, against the device's rated "
                     f"dense peak (datasheet TFLOP/s) for the dtype that did most of them: {used}.")
    return Section("Where the step goes (--profile)", headers, rows, notes, left={0, len(headers) - 1})


def _policy_notes(policy: str, p: ProfileSummary) -> list[str]:
    out = []
    total = sum(p.dtype_time.values()) or 1.0
    coverage = ", ".join(f"{d} {v / total:.0%}" for d, v in p.dtype_time.items() if d != "none" and v / total >= 0.01)
    flops = sum(p.dtype_flops.values())
    fl = ", ".join(f"{d} {v / flops:.0%}" for d, v in p.dtype_flops.items()) if flops else ""
    out.append(f"{policy}: op time by dtype {coverage or '—'}" + (f"; matmul/conv FLOPs {fl}" if fl else "") + ".")
    if p.scaler_s:
        out.append(f"{policy}: GradScaler's unscale/inf check and update {p.scaler_s * 1e3:.3g} ms per step "
                   f"({_pct(p.share(p.scaler_s))}).")
    if p.fp64_ops:
        t = sum(o.seconds for o in p.fp64_ops)
        ops = ", ".join(o.op for o in p.fp64_ops[:4])
        out.append(f"{policy}: float64 ops that the policy never asked for take {_pct(p.share(t))} of the step "
                   f"({ops}).")
        out += [f"{policy}: float64 enters at {s.source}: {s.code} — {s.op} {s.why}" for s in p.fp64_sources]
    if p.fp32_under_autocast:
        out.append(f"{policy}: in float32 under autocast: " + "; ".join(
            f"{o.op} {_pct(p.share(o.seconds))} ({o.why})" for o in p.fp32_under_autocast[:5]) + ".")
    out += [f"{policy}: warning during the profiled steps — {w}" for w in p.warnings]
    if p.trace_file:
        out.append(f"{policy}: Chrome trace {p.trace_file}")
    return out


def ops_section(report: Report) -> Section | None:
    rows_in = [(r, p) for r, p in _profiled(report) if not p.error]
    if not rows_in:
        return None
    headers = ["policy", "op", "dtype", "input shapes", "ms/step", "of step", "calls", "GFLOP/s", "of peak"]
    rows = []
    for r, p in rows_in:
        for o in p.ops[:TOP_SHOWN]:
            rows.append([r.policy, o.name, o.dtypes or "—", o.shapes or "—", num(o.seconds * 1e3, ".3g"),
                         _pct(p.share(o.seconds)), num(o.calls, ".3g"), num(o.gflops, ".3g"), _pct(o.utilisation)])
    notes = ["Top ops by time: matmul/conv and cast ops with everything they call, other ops by their self time."]
    return Section("Top ops per policy (--profile)", headers, rows, notes, left={0, 1, 2, 3}, wrap={3})


def profile_sections(report: Report) -> list[Section]:
    return [s for s in (breakdown_section(report), ops_section(report)) if s is not None]
