"""The recommendation: fastest stable policy whose primary metric stays within tolerance of fp32."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtypelab.bench.rounds import MIN_QUIET, disturbed_text
from dtypelab.core.disturbance import describe, was_disturbed
from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import BASELINE
from dtypelab.core.results import PolicyResult, Report
from dtypelab.core.scaler import scaler_notes
from dtypelab.core.stats import MIN_GAIN
from dtypelab.profile.explain import why


@dataclass(frozen=True)
class Tolerance:
    """How far the primary metric may move from fp32: relative ("1%") or absolute ("0.005")."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str | float) -> Tolerance:
        raw = str(text).strip()
        relative = raw.endswith("%")
        try:
            value = float(raw[:-1] if relative else raw)
        except ValueError:
            raise DtypelabError(
                f"bad tolerance {raw!r}: use a percentage like 1% or an absolute value like 0.005") from None
        if not math.isfinite(value) or value < 0:
            raise DtypelabError(f"bad tolerance {raw!r}: must be a finite number >= 0")
        return cls(value / 100 if relative else value, relative)

    def allowed(self, baseline: float) -> float:
        return abs(baseline) * self.value if self.relative else self.value

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.relative else f"{self.value:g}"


@dataclass(frozen=True)
class Recommendation:
    best: str | None
    lowest_memory: str | None
    verdicts: dict[str, str]  # short text per policy for the table
    sentences: tuple[str, ...]  # the explanation in words
    undecided: bool = False  # too disturbed to decide (``bench --strict`` exits non-zero)
    no_baseline: bool = False  # the fp32 baseline did not complete: nothing to compare with (bench exits 1)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def delta_text(value: float, base: float, tol: Tolerance) -> str:
    """Change of the metric vs the baseline, in the terms the tolerance is given in."""
    delta = value - base
    rel = f"{delta / abs(base) * 100:+.2f}%" if base else "n/a"
    return f"{rel}" if tol.relative else f"{delta:+.4g} ({rel})"


def judge(value: float, base: float, tol: Tolerance, higher: bool) -> tuple[bool, str]:
    """(accepted, how it compares): the tolerance is one-sided, so a metric that moved the good way always
    passes and reads 'better than fp32', never 'within 1%'."""
    gain = value - base if higher else base - value
    if gain > 0:
        return True, f"better than {BASELINE}"
    if gain == 0:
        return True, f"equal to {BASELINE}"
    ok = -gain <= tol.allowed(base)
    return ok, f"{'within' if ok else 'outside'} {tol}"


def tolerance_sentence(metric: str, tol: Tolerance, higher: bool) -> str:
    worse = "lower" if higher else "higher"
    return (f"Tolerance {tol} is one-sided: a policy's {metric} may be up to {tol} {worse} than {BASELINE}'s; "
            f"a better {metric} always passes.")


def speedup(result: PolicyResult, base: PolicyResult) -> float | None:
    """From paired rounds when they ran (their geometric mean), else the ratio of the runs' medians."""
    if result.speedup_ci is not None:
        return result.speedup_ci.point
    if result is base or result.policy == base.policy:
        return 1.0 if base.timing else None
    t, b = result.timing, base.timing
    return b.median / t.median if t and b and t.median > 0 else None


def speed_text(sp: float) -> str:
    """'2.52x faster than fp32', or '2.17x slower than fp32 (0.46x its speed)': a ratio below 1 never
    reads as 'x slower'."""
    if sp >= 1:
        return f"{sp:.2f}x faster than {BASELINE}"
    return f"{1 / sp:.2f}x slower than {BASELINE} ({sp:.2f}x its speed)"


def _short_reason(r: PolicyResult) -> str:
    if r.status == "skipped":
        return {"slow": "too slow here", "budget": "over budget"}.get(r.skip, "not on this hardware")
    if r.status in ("failed", "timeout", "oom"):
        return r.reason if len(r.reason) <= 60 else r.reason[:57] + "..."
    return r.status


def _details(report: Report) -> list[str]:
    """Facts worth a sentence of their own: GradScaler skips, output fidelity in inference."""
    out = []
    for r in report.results:
        out += [n if n.endswith(".") else n + "." for n in scaler_notes(r.scaler, len(r.losses), r.policy)]
        if report.config.mode == "infer" and r.policy != BASELINE and "sqnr_db" in r.fidelity:
            cos = r.fidelity.get("cos_min")
            out.append(f"{r.policy}: outputs {r.fidelity['sqnr_db']:.1f} dB SQNR vs {BASELINE}, "
                       f"max abs error {r.fidelity['max_abs_err']:.3g}"
                       + (f", worst cosine {cos:.4f}." if cos is not None else "."))
    base = report.result(BASELINE)
    for r in report.results:  # --profile: why each policy is (not) faster
        if r.profile is not None and r.ran:
            sp = speedup(r, base) if base is not None and r.policy != BASELINE else None
            dtype = r.info.compute_dtype if r.info else ""
            out.append("Why: " + why(r.policy, r.profile, base.profile if base else None, sp, dtype))
    return out


def disturbed_sentence(report: Report, best: str | None) -> str:
    """Which timings other processes disturbed, in words; "" when none was. The decision still comes from the
    medians: this says when not to trust it."""
    hit = [r for r in report.results if was_disturbed(r.disturbance)]
    if not hit:
        return ""
    parts = [f"{r.policy} ({describe(r.disturbance, subject=False)})" for r in hit]
    names = {r.policy for r in hit}
    lead = "Caution: the decision rests on disturbed timings. " if names & {best, BASELINE} else ""
    return (f"{lead}Other processes used the CPU while these policies' steps were timed: {', '.join(parts)}; their "
            "speeds are not reliable: re-run on a quiet machine before acting on them.")


def rounds_sentence(report: Report) -> str:
    """Which rounds other processes disturbed, in words, and what was done about them; "" when none."""
    parts = [disturbed_text(r.policy, r.rounds) for r in report.results if r.rounds]
    parts = [p for p in parts if p]
    if not parts:
        return ""
    return ("Disturbance: " + "; ".join(parts) + ". Rounds with a disturbed block are left out of the paired "
            f"speedups while {MIN_QUIET} quiet rounds remain.")


def recommend(report: Report) -> Recommendation:
    """Judge every result against the fp32 baseline of the same report."""
    cfg = report.config
    tol = Tolerance.parse(cfg.tolerance)
    metric, higher = cfg.metric, cfg.higher_is_better
    base = report.result(BASELINE)
    verdicts: dict[str, str] = {}
    sentences: list[str] = []
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in report.results:
        if not r.ran:
            verdicts[r.policy] = _short_reason(r)
            skipped.setdefault((f"{r.status} — {r.reason}", r.skip), []).append(r.policy)
    base_metric = base.metric(metric) if base and base.status == "ok" else None
    if base_metric is None or not math.isfinite(base_metric):
        why = f"{base.status}: {base.reason}" if base and base.status != "ok" else "it has no finite metric"
        sentences.append(f"No recommendation: the {BASELINE} baseline did not complete ({why}).")
        for (reason, _), names in skipped.items():
            sentences.append(f"{', '.join(names)}: {reason}.")
        return Recommendation(None, None, verdicts, tuple(sentences), no_baseline=True)

    accepted: list[PolicyResult] = []
    notes: dict[str, str] = {}
    for r in report.results:
        if not r.ran:
            continue
        value = r.metric(metric)
        sp = speedup(r, base)
        speed = speed_text(sp) if sp else "no timing"
        if r.status == "diverged":
            verdicts[r.policy] = f"diverged at step {r.first_nonfinite_step}"
            notes[r.policy] = f"{r.policy}: {speed} but diverged ({r.reason})."
        elif r.first_nonfinite_step is not None:
            verdicts[r.policy] = f"non-finite loss at step {r.first_nonfinite_step}"
            notes[r.policy] = f"{r.policy}: {speed} but the loss went non-finite at step {r.first_nonfinite_step}."
        elif value is None or not math.isfinite(value):
            verdicts[r.policy] = "no metric"
            notes[r.policy] = f"{r.policy}: {speed} but its {metric} is {value}."
        else:
            ok, where = judge(value, base_metric, tol, higher)
            delta = delta_text(value, base_metric, tol)
            if r.policy == BASELINE:
                verdicts[r.policy] = "baseline"
                accepted.append(r)
                continue
            verdicts[r.policy] = where
            notes[r.policy] = f"{r.policy}: {speed}, {metric} {_fmt(value)} ({delta}, {where})."
            cos = r.fidelity.get("cos_min") if cfg.mode == "infer" else None
            if ok and cos is not None and cos < cfg.min_cosine:  # the metric can hide drift the outputs show
                ok = False
                verdicts[r.policy] = f"cosine {cos:.4f} < {cfg.min_cosine:g}"
                notes[r.policy] = (f"{r.policy}: {speed}, {metric} {_fmt(value)} ({delta}) but its worst output "
                                   f"cosine vs {BASELINE} is {cos:.4f}, below {cfg.min_cosine:g}.")
            if ok:
                accepted.append(r)

    timed = [r for r in accepted if r.timing]
    paired = bool(base.rounds) and any(r.speedup_ci for r in accepted)
    unclear: list[PolicyResult] = []
    if paired:  # decide from the intervals of paired rounds, not from medians
        faster = [r for r in accepted if r.speedup_ci and r.speedup_ci.low > 1 + MIN_GAIN]
        unclear = [r for r in accepted if r.speedup_ci and r.speedup_ci.low <= 1 + MIN_GAIN <= r.speedup_ci.high]
        best = max(faster, key=lambda r: r.speedup_ci.point).policy if faster else BASELINE
    else:
        best = min(timed, key=lambda r: r.timing.median).policy if timed else None
    with_mem = [r for r in accepted if r.peak_memory_bytes is not None]
    lowest = min(with_mem, key=lambda r: r.peak_memory_bytes).policy if with_mem else None
    busy = paired and sum(b.disturbed for b in base.rounds) > len(base.rounds) / 2
    # Busy rounds decide nothing only where they could change the answer: an alternative whose interval reaches
    # above the no-gain band might be faster (or slower) on a quiet machine; one whose whole interval lies at or
    # below it cannot win either way, and then "keep fp32" stands.
    contenders = [r for r in accepted if r.policy != BASELINE and r.speedup_ci and r.speedup_ci.high > 1 + MIN_GAIN]
    too_busy = busy and bool(contenders)
    if too_busy:
        sentences.append(f"No recommendation: the machine was too busy to decide "
                         f"({disturbed_text(BASELINE, base.rounds)}) and "
                         f"{', '.join(r.policy for r in contenders)} might be faster on a quiet machine; re-run it "
                         "there.")
        best = None
    elif busy:
        sentences.append(f"Keep {BASELINE}: the machine was busy ({disturbed_text(BASELINE, base.rounds)}), but no "
                         f"alternative within {tol} on {metric} came out faster even so (every 95% interval at or "
                         f"below {1 + MIN_GAIN:.2f}x), so disturbance cannot change this decision ({BASELINE}: "
                         f"{_fmt(base_metric)}).")
        best = BASELINE
    elif best == BASELINE or best is None:
        measurably = "measurably faster (95% interval above 1)" if paired else "faster"
        sentences.append(f"Keep {BASELINE}: no other policy was both {measurably} and within {tol} on {metric} "
                         f"({BASELINE}: {_fmt(base_metric)}).")
    else:
        b = report.result(best)
        sp = speedup(b, base)
        ci = (f" (95% interval {b.speedup_ci.low:.2f}–{b.speedup_ci.high:.2f}x over {b.speedup_ci.rounds} paired "
              "rounds)") if paired and b.speedup_ci else ""
        sentences.append(
            f"Use {best}: {sp:.2f}x faster than {BASELINE}{ci}, {metric} {_fmt(b.metric(metric))} vs "
            f"{_fmt(base_metric)} ({delta_text(b.metric(metric), base_metric, tol)}, "
            f"{judge(b.metric(metric), base_metric, tol, higher)[1]})."
        )
        verdicts[best] = "recommended"
        noisy = [r.policy for r in (b, base) if r.timing.noisy] if not paired else []
        if noisy:
            sentences.append(f"Timings of {' and '.join(noisy)} were noisy: re-run before trusting a small gap.")
    if unclear:
        sentences.append("No measurable speed difference from " + BASELINE + ": " + ", ".join(
            f"{r.policy} {r.speedup_ci.point:.2f}x ({r.speedup_ci.low:.2f}–{r.speedup_ci.high:.2f})" for r in unclear)
            + "; the interval includes no gain, so the safer " + BASELINE + " numerics are preferred.")
        for r in unclear:
            if verdicts.get(r.policy, "").startswith(("within", "better", "equal")):
                verdicts[r.policy] = "no measurable gain"
    busy = rounds_sentence(report) if paired else disturbed_sentence(report, best)
    if busy:
        sentences.append(busy)
    for name, note in notes.items():
        if name != best:
            sentences.append(note)
    if notes:
        sentences.append(tolerance_sentence(metric, tol, higher))
    sentences += _details(report)
    if lowest and lowest != best:
        low, b = report.result(lowest), report.result(best or BASELINE)
        if low.peak_memory_bytes < 0.95 * (b.peak_memory_bytes or 0):  # smaller gaps are measurement noise
            sentences.append(f"Lowest peak memory within tolerance: {lowest} "
                             f"({low.peak_memory_bytes / 2**20:.1f} MB vs {b.peak_memory_bytes / 2**20:.1f} MB "
                             f"for {b.policy}).")
            verdicts[lowest] += ", lowest memory"
    for (reason, skip), names in skipped.items():
        hint = {"slow": "; use --force to run anyway", "budget": "; a larger --budget (0: none) runs it"}.get(skip, "")
        sentences.append(f"{', '.join(names)}: {reason}{hint}.")
    return Recommendation(best, lowest, verdicts, tuple(sentences), undecided=too_busy)
