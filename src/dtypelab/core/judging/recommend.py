"""The recommendation of a bench record: the fastest stable policy whose primary metric stays within tolerance of
fp32 (and, in inference, whose outputs stay close to fp32's), decided from paired rounds' intervals when they ran.
``recommend`` returns it as a ``Recommendation`` record; ``judged`` stores it in the report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dtypelab.core.disturbance import describe, was_disturbed
from dtypelab.core.judging.explain import why
from dtypelab.core.judging.memory import budget_verdicts, over, within_budget
from dtypelab.core.judging.notes import table_notes
from dtypelab.core.judging.prefer import gain_ci, safest
from dtypelab.core.judging.speed import speedup
from dtypelab.core.judging.verdicts import judged_runs, metric_text, not_run
from dtypelab.core.objectives import objective
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
from dtypelab.core.tolerance import BASELINE, delta_text, judge, tolerance_sentence

MEMORY_GAP = 0.95  # a lower peak is worth a sentence below this ratio (smaller gaps are measurement noise)


def disturbed_text(name: str, blocks: tuple[RoundBlock, ...]) -> str:
    """'other processes used 96% of a core during 7 of 12 fp32 blocks', or "" when none was disturbed."""
    hit = [b for b in blocks if b.disturbed]
    if not hit:
        return ""
    mean = sum(b.other_cores for b in hit) / len(hit)
    return f"other processes used {mean:.0%} of a core during {len(hit)} of {len(blocks)} {name} blocks"


def _details(report: Report, speedups: dict[str, float | None]) -> list[str]:
    """Facts worth a sentence of their own: GradScaler skips, output fidelity in inference, --profile's why."""
    out, baseline = [], report.baseline
    for r in report.results:
        out += [n if n.endswith(".") else n + "." for n in scaler_notes(r.scaler, len(r.losses), r.policy)]
        # fidelity is against the fp32 reference run's outputs, whichever policy --baseline names
        if report.config.mode == "infer" and r.policy != BASELINE and "sqnr_db" in r.fidelity:
            cos = r.fidelity.get("cos_min")
            out.append(f"{r.policy}: outputs {r.fidelity['sqnr_db']:.1f} dB SQNR vs {BASELINE}, "
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


@dataclass
class Pick:
    """What the evidence decides, before any sentence: which faster policies there are and how sure, the one chosen,
    and whether the machine was too busy for the choice to stand."""

    paired: bool  # decided from paired rounds' intervals
    best: str | None  # the fastest safe policy by the evidence (the baseline when none is measurably faster)
    preferred: str = ""  # why ``best`` is not simply the fastest (speeds that cannot be told apart)
    gain_not_shown: list[PolicyResult] = field(default_factory=list)  # intervals that include no gain
    by_median_only: list[PolicyResult] = field(default_factory=list)  # faster by medians, not measurably
    contenders: list[PolicyResult] = field(default_factory=list)  # might win on a quiet machine
    busy: bool = False  # most of the baseline's rounds were disturbed
    lowest: str | None = None  # the lowest peak memory within tolerance


def pick(report: Report, base: PolicyResult, accepted: list[PolicyResult]) -> Pick:
    """The decision as data, from the accepted policies' timings (paired intervals, else one run each, else the
    steps' spreads), or their energy (paired intervals only)."""
    cfg, baseline = report.config, report.baseline
    timed = [r for r in accepted if r.timing]
    paired = bool(base.rounds) and any(gain_ci(r, cfg.objective) for r in accepted)
    out = Pick(paired, baseline if base.timing or paired else None)
    cis = {r.policy: ci for r in accepted if (ci := gain_ci(r, cfg.objective)) is not None}
    if paired:  # decide from the intervals of paired rounds, not from medians
        faster = [r for r in accepted if r.policy in cis and cis[r.policy].low > 1 + MIN_GAIN]
        out.gain_not_shown = [r for r in accepted if r.policy in cis
                              and cis[r.policy].low <= 1 + MIN_GAIN <= cis[r.policy].high]
        if faster:
            chosen, out.preferred = safest(faster, cfg.metric, cfg.higher_is_better, cfg.objective)
            out.best = chosen.policy
    elif objective(cfg.objective).counts_joules:  # from paired rounds only: without them, no evidence of a saving
        pass
    elif cfg.runs:  # a script's runs, not repeated: one run per policy says nothing of run-to-run variation
        out.by_median_only = [r for r in timed if r.policy != baseline and (speedup(r, base) or 0) > 1 + MIN_GAIN]
    else:  # separate runs (a task without rounds): the medians decide only where the steps' spreads say they differ
        faster = [r for r in timed if r.policy != baseline and unpaired_faster(_timed(base), _timed(r))]
        out.by_median_only = [r for r in timed if r.policy != baseline and r not in faster
                              and (speedup(r, base) or 0) > 1 + MIN_GAIN]
        if faster:
            out.best = min(faster, key=lambda r: r.timing.median if r.timing else math.inf).policy
    with_mem = [(r.peak_memory_bytes, r.policy) for r in accepted if r.peak_memory_bytes is not None]
    out.lowest = min(with_mem, key=lambda pair: pair[0])[1] if with_mem else None
    out.busy = paired and sum(b.disturbed for b in base.rounds) > len(base.rounds) / 2
    # Busy rounds decide nothing only where they could change the answer: an alternative whose interval reaches
    # above the no-gain band might be faster (or slower) on a quiet machine; one whose whole interval lies at or
    # below it cannot win either way, and then "keep fp32" stands.
    out.contenders = [r for r in accepted if r.policy != baseline and r.policy in cis
                      and cis[r.policy].high > 1 + MIN_GAIN]
    return out


def _decision(report: Report, p: Pick, base: PolicyResult, base_metric: float) -> tuple[Decision, str | None, str]:
    """The decision and its first sentence."""
    cfg, baseline = report.config, report.baseline
    tol, metric = cfg.tolerance, cfg.metric
    # separate runs, no rounds: a win over a disturbed fp32 (slowed by other work) may be the disturbance's; a
    # disturbed winner, or keeping fp32, stands (disturbance only slows what it hits)
    if not p.paired and p.best not in (None, baseline) and was_disturbed(base.disturbance):
        return Decision.TOO_BUSY, None, (
            f"No recommendation: the machine was too busy to decide (other processes used the CPU while "
            f"{baseline}'s steps were timed: {describe(base.disturbance, subject=False)}), and every policy faster "
            f"than {baseline} may be so only because of it; re-run it on a quiet machine.")
    _, gain, shown = objective(cfg.objective).gain  # the intervals are of what the objective measures
    if p.busy and p.contenders:
        return Decision.TOO_BUSY, None, (
            f"No recommendation: the machine was too busy to decide ({disturbed_text(baseline, base.rounds)}) and "
            f"{', '.join(r.policy for r in p.contenders)} might {gain} on a quiet machine; re-run it there.")
    if p.busy:
        return Decision.KEEP_BASELINE_BUSY, baseline, (
            f"Keep {baseline}: the machine was busy ({disturbed_text(baseline, base.rounds)}), but no alternative "
            f"within {tol} on {metric} {shown} even so (every 95% interval at or below {1 + MIN_GAIN:.2f}x), "
            f"so disturbance cannot change this decision ({baseline}: {metric_text(base_metric)}).")
    if objective(cfg.objective).counts_joules:
        return _energy_decision(report, p, base, base_metric)
    if p.best in (baseline, None):
        measurably = ("measurably faster (95% interval above 1)" if p.paired else
                      "measurably faster (more than one run each)" if cfg.runs else
                      f"measurably faster (its steps faster than {baseline}'s, one-sided Mann-Whitney test at 5%)")
        return Decision.KEEP_BASELINE, baseline, (
            f"Keep {baseline}: no other policy was both {measurably} and within {tol} on {metric} "
            f"({baseline}: {metric_text(base_metric)}).")
    b = report.ran(p.best)
    ci = (f" (95% interval {b.speedup_ci.low:.2f}–{b.speedup_ci.high:.2f}x over {b.speedup_ci.rounds} paired "
          "rounds)") if p.paired and b.speedup_ci else ""
    value = b.metric(metric)
    assert value is not None  # the chosen policy was judged by its metric
    return Decision.USE, p.best, (
        f"Use {p.best}: {speedup(b, base):.2f}x faster than {baseline}{ci}, {metric} {metric_text(value)} vs "
        f"{metric_text(base_metric)} ({delta_text(value, base_metric, tol)}, "
        f"{judge(value, base_metric, tol, cfg.higher_is_better, baseline)[1]}).")


def _energy_decision(report: Report, p: Pick, base: PolicyResult, base_metric: float
                     ) -> tuple[Decision, str | None, str]:
    """--objective energy: the policy using measurably the least energy per sample within tolerance, from paired
    rounds' windows."""
    cfg, baseline = report.config, report.baseline
    tol, metric = cfg.tolerance, cfg.metric
    if p.best in (baseline, None):
        return Decision.KEEP_BASELINE, baseline, (
            f"Keep {baseline}: no other policy both used measurably less energy per sample (95% interval of "
            f"{baseline}'s joules over its own above {1 + MIN_GAIN:.2f}, from paired rounds) and stayed within {tol} "
            f"on {metric} ({baseline}: {metric_text(base_metric)}).")
    b = report.result(p.best)
    assert b is not None and b.energy_ci is not None  # chosen from the policies with an energy interval
    ci, e, eb = b.energy_ci, b.energy, base.energy
    value = b.metric(metric)
    assert value is not None  # accepted: its metric was judged
    per = (f" ({e.joules_per_sample:.3g} vs {eb.joules_per_sample:.3g} J per sample)" if e and eb else "")
    return Decision.USE, p.best, (
        f"Use {p.best}: {ci.point:.2f}x less energy per sample than {baseline}{per}, 95% interval "
        f"{ci.low:.2f}–{ci.high:.2f}x over {ci.rounds} paired rounds; {metric} {metric_text(value)} vs "
        f"{metric_text(base_metric)} ({delta_text(value, base_metric, tol)}, "
        f"{judge(value, base_metric, tol, cfg.higher_is_better, baseline)[1]}).")


def _marked(verdicts: dict[str, PolicyVerdict], names: list[str], verdict: Verdict, text: str,
            only: tuple[Verdict, ...] = ()) -> None:
    for name in names:
        if not only or verdicts[name].verdict in only:
            verdicts[name] = replace(verdicts[name], verdict=verdict, text=text)


def _no_gain(report: Report, p: Pick, base: PolicyResult) -> list[str]:
    """The sentences for policies faster by their medians or intervals, but not measurably."""
    baseline, out = report.baseline, []
    if p.by_median_only and report.config.runs:
        out.append(f"Not measurably faster than {baseline}: " + ", ".join(
            f"{r.policy} {speedup(r, base):.2f}x by one run's median step" for r in p.by_median_only)
            + f" (each policy ran once, in its own process: the steps of one run are not replicates of another, so "
              f"a gap between two runs cannot be told from run-to-run variation; --runs N repeats them); the safer "
              f"{baseline} numerics are kept.")
    elif p.by_median_only:
        out.append(f"Not measurably faster than {baseline} (their steps' spread overlaps {baseline}'s: one-sided "
                   f"Mann-Whitney test, {1 - CONFIDENCE:.0%} level): " + ", ".join(
                       f"{r.policy} {speedup(r, base):.2f}x by medians over {len(_timed(r))} steps"
                       for r in p.by_median_only) + "; the safer " + baseline + " numerics are kept.")
    if p.gain_not_shown:
        what = objective(report.config.objective).gain[0]
        cis = [(r.policy, gain_ci(r, report.config.objective)) for r in p.gain_not_shown]
        out.append(f"No measurable {what} difference from " + baseline + ": " + ", ".join(
            f"{name} {ci.point:.2f}x ({ci.low:.2f}–{ci.high:.2f})" for name, ci in cis if ci)
            + "; the interval includes no gain, so the safer " + baseline + " numerics are preferred.")
    return out


def _notable_lowest(report: Report, lowest: str | None, best: str | None) -> str | None:
    """The policy with the lowest peak within tolerance, when it is not the one chosen and needs measurably less
    (below ``MEMORY_GAP`` of the chosen policy's peak); else None."""
    if not lowest or lowest == best:
        return None
    low, b = report.ran(lowest), report.ran(best or report.baseline)
    return lowest if (low.peak_memory_bytes or 0) < MEMORY_GAP * (b.peak_memory_bytes or 0) else None


def _memory_sentence(report: Report, lowest: str, best: str | None) -> str:
    low, b = report.ran(lowest), report.ran(best or report.baseline)
    return (f"Lowest peak memory within tolerance: {lowest} ({size_text(low.peak_memory_bytes)} vs "
            f"{size_text(b.peak_memory_bytes)} for {b.policy}).")


def recommend(report: Report) -> Recommendation:
    """Judge every result against the baseline of the same report (fp32 unless the run named another): the verdicts
    and the decision as data first (``verdicts.judged_runs``, ``pick``, ``_decision``), then the sentences that say
    them."""
    cfg, baseline = report.config, report.baseline
    base = report.result(baseline)
    unrun = {r.policy: not_run(r, baseline) for r in report.results if not r.ran}
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in report.results:
        if not r.ran:
            skipped.setdefault((f"{r.status} — {r.reason}", r.skip), []).append(r.policy)
    base_metric = base.metric(cfg.metric) if base and base.status == "ok" else None
    if base is None or base_metric is None or not math.isfinite(base_metric):
        why_not = f"{base.status}: {base.reason}" if base and base.status != "ok" else "it has no finite metric"
        reason = f"No recommendation: the {baseline} baseline did not complete ({why_not})."
        ran = {r.policy: PolicyVerdict(r.policy, Verdict.UNJUDGED, "") for r in report.results if r.ran}
        return Recommendation(Decision.NO_BASELINE, None, reason, _ordered(report, {**unrun, **ran}),
                              sentences=(reason, *_skip_sentences(skipped)), notes=tuple(table_notes(report)))
    verdicts, accepted, notes = judged_runs(report, base, base_metric, cfg.tolerance)
    untimed = [r.policy for r in report.results if r.ran and r.timing is None and r.speedup_ci is None]
    reason = _no_energy(report)  # --objective energy decides from measured joules only
    if untimed:  # no decision without evidence: a policy that ran untimed might be the fastest
        reason = (f"No recommendation: {', '.join(untimed)} ran but timed no step, so nothing can be said of speed; "
                  "re-run once every policy's steps are timed.")
        for name in untimed:
            verdicts[name] = replace(verdicts[name], verdict=Verdict.UNTIMED, text="not timed", speedup=None)
    if reason:
        return Recommendation(Decision.NO_EVIDENCE, None, reason, _ordered(report, {**unrun, **verdicts}),
                              sentences=(reason, *_skip_sentences(skipped)),
                              notes=tuple(table_notes(report, verdicts)))
    p = pick(report, base, accepted)
    decision, best, first = _decision(report, p, base, base_metric)
    budgeted = best == baseline and bool(over(base, cfg.memory_budget_bytes))
    if budgeted:  # the baseline it would keep does not fit --memory-budget: the budget decides instead
        decision, best, first = within_budget(report, accepted, verdicts)
        verdicts.update(budget_verdicts(report, best, verdicts))
    sentences = [first]
    if decision == Decision.USE and not budgeted:
        assert best is not None
        _marked(verdicts, [best], Verdict.RECOMMENDED, "recommended")
        noisy = [r.policy for r in (report.ran(best), base) if r.timing and r.timing.noisy] if not p.paired else []
        sentences += [p.preferred] if p.preferred else []
        sentences += [f"Timings of {' and '.join(noisy)} were noisy: re-run before trusting a small gap."] if noisy \
            else []
    _marked(verdicts, [r.policy for r in p.by_median_only + p.gain_not_shown], Verdict.NO_GAIN, "no measurable gain",
            only=(Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN))
    sentences += _no_gain(report, p, base)
    sentences += [t for t in [rounds_sentence(report) if p.paired else disturbed_sentence(report, best)] if t]
    sentences += [note for name, note in notes.items() if name != best]
    sentences += [tolerance_sentence(cfg.metric, cfg.tolerance, cfg.higher_is_better, baseline)] if notes else []
    sentences += _details(report, {name: v.speedup for name, v in verdicts.items()}) + run_notes(report)
    lowest = _notable_lowest(report, p.lowest, best)
    if lowest is not None:
        v = verdicts[lowest]
        verdicts[lowest] = replace(v, text=v.text + ", lowest memory", lowest_memory=True)
        sentences.append(_memory_sentence(report, lowest, best))
    sentences += _skip_sentences(skipped)
    return Recommendation(decision, best, sentences[0], _ordered(report, {**unrun, **verdicts}), p.lowest,
                          tuple(sentences), tuple(table_notes(report, verdicts)))


def _no_energy(report: Report) -> str:
    """--objective energy with no energy measured: why, in a sentence; "" otherwise."""
    if not objective(report.config.objective).counts_joules or any(r.energy for r in report.results if r.ran):
        return ""
    source = report.energy_source
    why = source.why if source and source.why else "the interleaved rounds, whose windows measure it, did not run"
    return f"No recommendation: --objective energy needs measured energy, and none was measured ({why})."


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
