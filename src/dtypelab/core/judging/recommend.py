"""The recommendation of a bench record: the fastest stable policy whose primary metric stays within tolerance of
fp32 (and, in inference, whose outputs stay close to fp32's), decided from paired rounds' intervals when they ran.
``recommend`` returns it as a ``Recommendation`` record; ``judged`` stores it in the report."""

from __future__ import annotations

import math
from dataclasses import replace

from dtypelab.core.disturbance import describe, was_disturbed
from dtypelab.core.judging.explain import why
from dtypelab.core.judging.memory import over, within_budget
from dtypelab.core.judging.notes import table_notes
from dtypelab.core.judging.prefer import safest
from dtypelab.core.judging.speed import speed_text, speedup
from dtypelab.core.results import (
    Decision,
    PolicyResult,
    PolicyVerdict,
    Recommendation,
    Report,
    RoundBlock,
    Verdict,
)
from dtypelab.core.scaler import scaler_notes
from dtypelab.core.stats import CONFIDENCE, MIN_GAIN, MIN_QUIET, unpaired_faster
from dtypelab.core.text import size_text
from dtypelab.core.tolerance import Tolerance, delta_text, judge, tolerance_sentence

MEMORY_GAP = 0.95  # a lower peak is worth a sentence below this ratio (smaller gaps are measurement noise)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def disturbed_text(name: str, blocks: tuple[RoundBlock, ...]) -> str:
    """'other processes used 96% of a core during 7 of 12 fp32 blocks', or "" when none was disturbed."""
    hit = [b for b in blocks if b.disturbed]
    if not hit:
        return ""
    mean = sum(b.other_cores for b in hit) / len(hit)
    return f"other processes used {mean:.0%} of a core during {len(hit)} of {len(blocks)} {name} blocks"


_NOT_RUN = {"skipped": {"slow": (Verdict.SKIPPED_SLOW, "too slow here"),
                        "budget": (Verdict.SKIPPED_BUDGET, "over budget"),
                        "inapplicable": (Verdict.SKIPPED_INAPPLICABLE, "does not apply"),
                        "baseline": (Verdict.SKIPPED_BASELINE, "not run: fp32 failed")},
            "failed": Verdict.FAILED, "timeout": Verdict.TIMEOUT, "oom": Verdict.OOM,
            "interrupted": Verdict.INTERRUPTED}


def _not_run(r: PolicyResult, baseline: str) -> PolicyVerdict:
    if r.status == "skipped":
        verdict, text = _NOT_RUN["skipped"].get(r.skip, (Verdict.SKIPPED_UNSUPPORTED, "not on this hardware"))
        text = text.replace("fp32", baseline) if r.skip == "baseline" else text
    else:
        verdict = _NOT_RUN.get(r.status, Verdict.FAILED)
        text = r.reason if len(r.reason) <= 60 else r.reason[:57] + "..."
        text = text if r.status in ("failed", "timeout", "oom") else r.status
    return PolicyVerdict(r.policy, verdict, text)


def _details(report: Report, speedups: dict[str, float | None]) -> list[str]:
    """Facts worth a sentence of their own: GradScaler skips, output fidelity in inference, --profile's why."""
    out, baseline = [], report.baseline
    for r in report.results:
        out += [n if n.endswith(".") else n + "." for n in scaler_notes(r.scaler, len(r.losses), r.policy)]
        if report.config.mode == "infer" and r.policy != baseline and "sqnr_db" in r.fidelity:
            cos = r.fidelity.get("cos_min")
            out.append(f"{r.policy}: outputs {r.fidelity['sqnr_db']:.1f} dB SQNR vs {baseline}, "
                       f"max abs error {r.fidelity['max_abs_err']:.3g}"
                       + (f", worst cosine {cos:.4f}." if cos is not None else "."))
    base = report.result(baseline)
    for r in report.results:
        if r.profile is not None and r.ran:
            sp = speedups.get(r.policy) if r.policy != baseline else None
            dtype = r.info.compute_dtype if r.info else ""
            out.append("Why: " + why(r.policy, r.profile, base.profile if base else None, sp, dtype))
    return out


def disturbed_sentence(report: Report, best: str | None) -> str:
    """Which policies' own runs other processes disturbed, in words; "" when none was."""
    hit = [r for r in report.results if was_disturbed(r.disturbance)]
    if not hit:
        return ""
    parts = [f"{r.policy} ({describe(r.disturbance, subject=False)})" for r in hit]
    names = {r.policy for r in hit}
    lead = "Caution: the decision rests on disturbed timings. " if best and names & {best, report.baseline} else ""
    return (f"{lead}Other processes used the CPU while these policies' steps were timed: {', '.join(parts)}; their "
            "speeds are not reliable: re-run on a quiet machine before acting on them.")


def rounds_sentence(report: Report) -> str:
    """Which rounds other processes disturbed, in words, and what was done about them; "" when none."""
    parts = [p for p in (disturbed_text(r.policy, r.rounds) for r in report.results if r.rounds) if p]
    if not parts:
        return ""
    return ("Disturbance: " + "; ".join(parts) + ". Rounds with a disturbed block are left out of the paired "
            f"speedups while {MIN_QUIET} quiet rounds remain.")


def _judged_runs(report: Report, base: PolicyResult, base_metric: float, tol: Tolerance
                 ) -> tuple[dict[str, PolicyVerdict], list[PolicyResult], dict[str, str]]:
    """Each policy that ran, judged on its own: (verdicts, the accepted results, a sentence per policy)."""
    cfg, baseline = report.config, report.baseline
    metric, higher = cfg.metric, cfg.higher_is_better
    verdicts: dict[str, PolicyVerdict] = {}
    accepted: list[PolicyResult] = []
    notes: dict[str, str] = {}
    for r in report.results:
        if not r.ran:
            continue
        value = r.metric(metric)
        numerics = r.info is not None and r.info.numerics_only  # emulated: its steps' time is not its format's
        sp = None if numerics else speedup(r, base)
        ci = None if numerics else r.speedup_ci
        finite = value is not None and math.isfinite(value) and r.policy != baseline
        common = {"speedup": sp, "speedup_low": ci.low if ci else None, "speedup_high": ci.high if ci else None,
                  "metric": value, "delta": delta_text(value, base_metric, tol) if finite else ""}
        speed = "emulated (numerics only)" if numerics else speed_text(sp, baseline) if sp else "no timing"
        if r.status == "diverged":
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.DIVERGED, f"diverged at step {r.first_nonfinite_step}",
                                               **common)
            notes[r.policy] = f"{r.policy}: {speed} but diverged ({r.reason})."
        elif r.first_nonfinite_step is not None:
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NONFINITE,
                                               f"non-finite loss at step {r.first_nonfinite_step}", **common)
            notes[r.policy] = f"{r.policy}: {speed} but the loss went non-finite at step {r.first_nonfinite_step}."
        elif value is None or not math.isfinite(value):
            verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NO_METRIC, "no metric", **common)
            notes[r.policy] = f"{r.policy}: {speed} but its {metric} is {value}."
        else:
            ok, where = judge(value, base_metric, tol, higher, baseline)
            delta = delta_text(value, base_metric, tol)
            if r.policy == baseline:
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.BASELINE, "baseline", **common)
                accepted.append(r)
                continue
            kind = Verdict.BETTER if where.startswith("better") else Verdict.EQUAL if where.startswith("equal") \
                else Verdict.WITHIN if ok else Verdict.OUTSIDE
            verdicts[r.policy] = PolicyVerdict(r.policy, kind, where, **common)
            notes[r.policy] = f"{r.policy}: {speed}, {metric} {_fmt(value)} ({delta}, {where})."
            cos = r.fidelity.get("cos_min") if cfg.mode == "infer" else None
            if ok and cos is not None and cos < cfg.min_cosine:  # the metric can hide drift the outputs show
                ok = False
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.COSINE, f"cosine {cos:.4f} < {cfg.min_cosine:g}",
                                                   **common)
                notes[r.policy] = (f"{r.policy}: {speed}, {metric} {_fmt(value)} ({delta}) but its worst output "
                                   f"cosine vs {baseline} is {cos:.4f}, below {cfg.min_cosine:g}.")
            if ok and numerics:  # its metric, never its speed
                ok = False
                needs = r.info.speed_needs or "hardware that runs its format"
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.NUMERICS_ONLY, f"numerics only: {where}",
                                                   **common)
                notes[r.policy] = (f"{r.policy}: numerically {where} on {metric} ({_fmt(value)}, {delta}) on this "
                                   f"model, emulated; its speed needs {needs}.")
                if r.conversion and not r.conversion.get("converted"):  # the filter took nothing: say so
                    verdicts[r.policy] = replace(verdicts[r.policy], text="numerics only: no layer converted")
                    notes[r.policy] = (f"{r.policy}: converts no layer of this model (its filter, as on a GPU, left "
                                       "every Linear out), so it ran as its float part alone; the -all variant "
                                       "emulates every layer whose shape the format takes.")
            too_big = over(r, cfg.memory_budget_bytes) if ok else ""
            if too_big:  # the fastest policy within tolerance that fits is the answer, not the fastest
                ok = False
                verdicts[r.policy] = PolicyVerdict(r.policy, Verdict.OVER_MEMORY, too_big, **common)
                notes[r.policy] = f"{r.policy}: {speed}, {metric} {_fmt(value)} ({delta}, {where}), but it {too_big}."
            if ok:
                accepted.append(r)
    return verdicts, accepted, notes


def recommend(report: Report) -> Recommendation:
    """Judge every result against the baseline of the same report (fp32 unless the run named another)."""
    cfg, baseline = report.config, report.baseline
    tol = cfg.tolerance
    metric, higher = cfg.metric, cfg.higher_is_better
    base = report.result(baseline)
    skipped: dict[tuple[str, str], list[str]] = {}
    not_run = {r.policy: _not_run(r, baseline) for r in report.results if not r.ran}
    for r in report.results:
        if not r.ran:
            skipped.setdefault((f"{r.status} — {r.reason}", r.skip), []).append(r.policy)
    base_metric = base.metric(metric) if base and base.status == "ok" else None
    if base is None or base_metric is None or not math.isfinite(base_metric):
        why_not = f"{base.status}: {base.reason}" if base and base.status != "ok" else "it has no finite metric"
        reason = f"No recommendation: the {baseline} baseline did not complete ({why_not})."
        sentences = [reason, *_skip_sentences(skipped)]
        ran = {r.policy: PolicyVerdict(r.policy, Verdict.UNJUDGED, "") for r in report.results if r.ran}
        return Recommendation(Decision.NO_BASELINE, None, reason, _ordered(report, {**not_run, **ran}),
                              sentences=tuple(sentences), notes=tuple(table_notes(report)))

    verdicts, accepted, notes = _judged_runs(report, base, base_metric, tol)
    untimed = [r for r in report.results if r.ran and r.timing is None and r.speedup_ci is None]
    if untimed:  # no decision without evidence: a policy that ran untimed might be the fastest
        names = ", ".join(r.policy for r in untimed)
        reason = (f"No recommendation: {names} ran but timed no step, so nothing can be said of speed; "
                  "re-run once every policy's steps are timed.")
        for r in untimed:
            verdicts[r.policy] = replace(verdicts[r.policy], verdict=Verdict.UNTIMED, text="not timed",
                                         speedup=None)
        return Recommendation(Decision.NO_EVIDENCE, None, reason, _ordered(report, {**not_run, **verdicts}),
                              sentences=(reason, *_skip_sentences(skipped)),
                              notes=tuple(table_notes(report, verdicts)))
    timed = [r for r in accepted if r.timing]
    paired = bool(base.rounds) and any(r.speedup_ci for r in accepted)
    unclear: list[PolicyResult] = []
    unsure: list[PolicyResult] = []
    preferred = ""
    if paired:  # decide from the intervals of paired rounds, not from medians
        faster = [r for r in accepted if r.speedup_ci and r.speedup_ci.low > 1 + MIN_GAIN]
        unclear = [r for r in accepted if r.speedup_ci and r.speedup_ci.low <= 1 + MIN_GAIN <= r.speedup_ci.high]
        best: str | None = baseline
        if faster:
            chosen, preferred = safest(faster, metric, higher)
            best = chosen.policy
    elif cfg.runs:  # a script's runs, not repeated: one run per policy says nothing of run-to-run variation
        faster = []
        unsure = [r for r in timed if r.policy != baseline and (speedup(r, base) or 0) > 1 + MIN_GAIN]
        best = baseline if base.timing else None
    else:  # separate runs (a task without rounds): the medians decide only where the steps' spreads say they differ
        faster = [r for r in timed if r.policy != baseline and unpaired_faster(_timed(base), _timed(r))]
        unsure = [r for r in timed if r.policy != baseline and r not in faster and speedup(r, base) > 1 + MIN_GAIN]
        best = min(faster, key=lambda r: r.timing.median).policy if faster else baseline if base.timing else None
    with_mem = [r for r in accepted if r.peak_memory_bytes is not None]
    lowest = min(with_mem, key=lambda r: r.peak_memory_bytes).policy if with_mem else None
    busy = paired and sum(b.disturbed for b in base.rounds) > len(base.rounds) / 2
    # Busy rounds decide nothing only where they could change the answer: an alternative whose interval reaches
    # above the no-gain band might be faster (or slower) on a quiet machine; one whose whole interval lies at or
    # below it cannot win either way, and then "keep fp32" stands.
    contenders = [r for r in accepted if r.policy != baseline and r.speedup_ci and r.speedup_ci.high > 1 + MIN_GAIN]
    sentences: list[str] = []
    # separate runs, no rounds: a win over a disturbed fp32 (slowed by other work) may be the disturbance's; a
    # disturbed winner, or keeping fp32, stands (disturbance only slows what it hits)
    if not paired and best not in (None, baseline) and was_disturbed(base.disturbance):
        decision, best = Decision.TOO_BUSY, None
        sentences.append(f"No recommendation: the machine was too busy to decide (other processes used the CPU while "
                         f"{baseline}'s steps were timed: {describe(base.disturbance, subject=False)}), and every "
                         f"policy faster than {baseline} may be so only because of it; re-run it on a quiet machine.")
    elif busy and contenders:
        decision, best = Decision.TOO_BUSY, None
        sentences.append(f"No recommendation: the machine was too busy to decide "
                         f"({disturbed_text(baseline, base.rounds)}) and "
                         f"{', '.join(r.policy for r in contenders)} might be faster on a quiet machine; re-run it "
                         "there.")
    elif busy:
        decision, best = Decision.KEEP_BASELINE_BUSY, baseline
        sentences.append(f"Keep {baseline}: the machine was busy ({disturbed_text(baseline, base.rounds)}), but no "
                         f"alternative within {tol} on {metric} came out faster even so (every 95% interval at or "
                         f"below {1 + MIN_GAIN:.2f}x), so disturbance cannot change this decision ({baseline}: "
                         f"{_fmt(base_metric)}).")
    elif best == baseline or best is None:
        decision, best = Decision.KEEP_BASELINE, baseline
        measurably = ("measurably faster (95% interval above 1)" if paired else
                      "measurably faster (more than one run each)" if cfg.runs else
                      f"measurably faster (its steps faster than {baseline}'s, one-sided Mann-Whitney test at 5%)")
        sentences.append(f"Keep {baseline}: no other policy was both {measurably} and within {tol} on {metric} "
                         f"({baseline}: {_fmt(base_metric)}).")
    else:
        decision = Decision.USE
        b = report.result(best)
        sp = speedup(b, base)
        ci = (f" (95% interval {b.speedup_ci.low:.2f}–{b.speedup_ci.high:.2f}x over {b.speedup_ci.rounds} paired "
              "rounds)") if paired and b.speedup_ci else ""
        sentences.append(
            f"Use {best}: {sp:.2f}x faster than {baseline}{ci}, {metric} {_fmt(b.metric(metric))} vs "
            f"{_fmt(base_metric)} ({delta_text(b.metric(metric), base_metric, tol)}, "
            f"{judge(b.metric(metric), base_metric, tol, higher, baseline)[1]})."
        )
        verdicts[best] = replace(verdicts[best], verdict=Verdict.RECOMMENDED, text="recommended")
        if preferred:
            sentences.append(preferred)
        noisy = [r.policy for r in (b, base) if r.timing.noisy] if not paired else []
        if noisy:
            sentences.append(f"Timings of {' and '.join(noisy)} were noisy: re-run before trusting a small gap.")
    if best == baseline and over(base, cfg.memory_budget_bytes):
        decision, best = within_budget(report, accepted, verdicts, sentences)
    if unsure and cfg.runs:
        sentences.append(f"Not measurably faster than {baseline}: " + ", ".join(
            f"{r.policy} {speedup(r, base):.2f}x by one run's median step" for r in unsure)
            + f" (each policy ran once, in its own process: the steps of one run are not replicates of another, so "
              f"a gap between two runs cannot be told from run-to-run variation; --runs N repeats them); the safer "
              f"{baseline} numerics are kept.")
        for r in unsure:
            if verdicts[r.policy].verdict in (Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN):
                verdicts[r.policy] = replace(verdicts[r.policy], verdict=Verdict.NO_GAIN, text="no measurable gain")
    elif unsure:
        sentences.append(f"Not measurably faster than {baseline} (their steps' spread overlaps {baseline}'s: one-sided "
                         f"Mann-Whitney test, {1 - CONFIDENCE:.0%} level): " + ", ".join(
                             f"{r.policy} {speedup(r, base):.2f}x by medians over {len(_timed(r))} steps"
                             for r in unsure) + "; the safer " + baseline + " numerics are kept.")
        for r in unsure:
            if verdicts[r.policy].verdict in (Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN):
                verdicts[r.policy] = replace(verdicts[r.policy], verdict=Verdict.NO_GAIN, text="no measurable gain")
    if unclear:
        sentences.append("No measurable speed difference from " + baseline + ": " + ", ".join(
            f"{r.policy} {r.speedup_ci.point:.2f}x ({r.speedup_ci.low:.2f}–{r.speedup_ci.high:.2f})" for r in unclear)
            + "; the interval includes no gain, so the safer " + baseline + " numerics are preferred.")
        for r in unclear:
            if verdicts[r.policy].verdict in (Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN):
                verdicts[r.policy] = replace(verdicts[r.policy], verdict=Verdict.NO_GAIN, text="no measurable gain")
    busy_text = rounds_sentence(report) if paired else disturbed_sentence(report, best)
    if busy_text:
        sentences.append(busy_text)
    sentences += [note for name, note in notes.items() if name != best]
    if notes:
        sentences.append(tolerance_sentence(metric, tol, higher, baseline))
    sentences += _details(report, {name: v.speedup for name, v in verdicts.items()})
    sentences += run_notes(report)
    if lowest and lowest != best:
        low, b = report.result(lowest), report.result(best or baseline)
        if low.peak_memory_bytes < MEMORY_GAP * (b.peak_memory_bytes or 0):
            sentences.append(f"Lowest peak memory within tolerance: {lowest} "
                             f"({size_text(low.peak_memory_bytes)} vs {size_text(b.peak_memory_bytes)} "
                             f"for {b.policy}).")
            v = verdicts[lowest]
            verdicts[lowest] = replace(v, text=v.text + ", lowest memory", lowest_memory=True)
    sentences += _skip_sentences(skipped)
    return Recommendation(decision, best, sentences[0], _ordered(report, {**not_run, **verdicts}), lowest,
                          tuple(sentences), tuple(table_notes(report, verdicts)))


def _timed(r: PolicyResult) -> tuple[float, ...]:
    """A run's timed steps (its warm-up left out)."""
    return r.step_times_s[r.warmup:]


def run_notes(report: Report) -> list[str]:
    """What runs found worth a sentence (``PolicyResult.notes``), each said once for the policies it is true of."""
    said: dict[str, list[str]] = {}
    for r in report.results:
        for note in r.notes:
            said.setdefault(note.rstrip("."), []).append(r.policy)
    return [f"{', '.join(names)}: {note}." for note, names in said.items()]


def _skip_sentences(skipped: dict[tuple[str, str], list[str]]) -> list[str]:
    hints = {"slow": "; use --force to run anyway", "budget": "; a larger --budget (0: none) runs it",
             "baseline": "; --keep-going runs them anyway"}
    return [f"{', '.join(names)}: {text}{hints.get(skip, '')}." for (text, skip), names in skipped.items()]


def _ordered(report: Report, verdicts: dict[str, PolicyVerdict]) -> tuple[PolicyVerdict, ...]:
    return tuple(verdicts[r.policy] for r in report.results if r.policy in verdicts)


def judged(report: Report) -> Report:
    """The report with its recommendation (recomputed from its results)."""
    return replace(report, recommendation=recommend(report))
