"""Judging a measured serving record (``bench --mode generate``) by bench's own rule: each policy's gain over the
baseline from paired, interleaved rounds (``core.pairing``: the geometric mean of the baseline's seconds, or joules,
over the policy's, round by round, with a Student-t interval; disturbed rounds left out while enough quiet ones
remain), and "faster" only where the whole interval clears the no-gain band (``core.stats.measurably_faster``).
Quality first: a policy whose perplexity moved past the tolerance is outside, whatever its speed."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.pairing import paired_gain
from dtypelab.core.results import Decision, GenerateFigures, GeneratePolicy, RoundBlock, SpeedupInterval, Verdict
from dtypelab.core.stats import MIN_GAIN, measurably_faster
from dtypelab.core.tolerance import Tolerance, judge

UNSTEADY = 2.0  # a policy whose slowest round took this many times its fastest is said to be unsteady


def objective_value(f: GenerateFigures, objective: str, gen_len: int) -> float:
    """Higher is better for every objective (latency and energy: their inverse)."""
    if objective_of(objective).counts_joules:
        jpt = f.energy.joules_per_token if f.energy else None
        return 1.0 / jpt if jpt else 0.0
    if objective == "prefill":
        return f.prefill_tok_s or 0.0
    if objective == "latency":
        total = (f.ttft_s or 0.0) + (gen_len - 1) * (f.token_latency_s or 0.0)
        return 1.0 / total if total > 0 else 0.0
    return f.decode_tok_s or 0.0


def round_seconds(f: GenerateFigures, objective: str) -> tuple[float, ...]:
    """Each round's seconds of what a timed objective counts (lower: faster): the prefill, the decode, or both; an
    objective counting joules: each round's joules per generated token."""
    if objective_of(objective).counts_joules:
        return f.energy_runs
    if objective == "prefill":
        return f.ttft_runs_s
    if objective == "decode":
        return f.decode_runs_s
    return tuple(a + b for a, b in zip(f.ttft_runs_s, f.decode_runs_s, strict=True))


def _timed_blocks(f: GenerateFigures, objective: str) -> tuple[RoundBlock, ...]:
    """The rounds' blocks with the objective's seconds in place of a whole generation's."""
    return tuple(replace(b, median_s=s) for b, s in zip(f.blocks, round_seconds(f, objective), strict=True))


def gain(f: GenerateFigures, base: GenerateFigures, objective: str) -> SpeedupInterval | None:
    """The baseline's seconds (energy: joules) over this policy's, paired by round (by what the objective pairs
    blocks by: core.pairing); None without paired rounds."""
    judged_by = objective_of(objective)
    if judged_by.counts_joules:
        return paired_gain(judged_by, base.blocks, f.blocks)
    return paired_gain(judged_by, _timed_blocks(base, objective), _timed_blocks(f, objective))


def trusted_gain(ci: SpeedupInterval | None) -> bool:
    """Faster beyond doubt: the whole interval above the no-gain band, and no disturbed round in it (a busy
    neighbour slows whichever policy it overlaps)."""
    return ci is not None and measurably_faster(ci.low) and ci.disturbed <= ci.dropped


@dataclass(frozen=True)
class Judged:
    policies: tuple[GeneratePolicy, ...]
    chosen: str
    decision: Decision
    sentence: str


def judge_generation(policies: list[GeneratePolicy], base: str, tol: Tolerance, objective: str,
                     gen_len: int) -> Judged:
    """Each policy's verdict and gain, the chosen one (the largest trusted gain among those within the tolerance)
    and the decision in a sentence."""
    baseline = next((p for p in policies if p.policy == base and p.status == "ok"), None)
    if baseline is None or baseline.quality is None or baseline.generate is None:
        return Judged(tuple(policies), "", Decision.NO_BASELINE,
                      f"the {base} baseline did not complete: nothing to judge the policies against")
    out = [_verdict(p, baseline, tol, objective) for p in policies]
    accepted = [p for p in out if p.verdict == Verdict.WITHIN and p.gain is not None]
    best = max(accepted, key=lambda p: p.gain.point if p.gain else 0.0, default=None)
    if best is None:
        out = [replace(p, verdict=Verdict.BASELINE) if p.policy == base else p for p in out]
        return Judged(tuple(out), base, Decision.KEEP_BASELINE, _kept_sentence(base, tol, objective, out))
    out = [replace(p, verdict=Verdict.RECOMMENDED) if p.policy == best.policy else p for p in out]
    return Judged(tuple(out), best.policy, Decision.USE, _chosen_sentence(best, base, tol, objective))


def _verdict(p: GeneratePolicy, baseline: GeneratePolicy, tol: Tolerance, objective: str) -> GeneratePolicy:
    if p.status != "ok" or p.quality is None or p.generate is None:
        return p
    if p.policy == baseline.policy:
        return replace(p, verdict=Verdict.BASELINE)
    assert baseline.quality is not None and baseline.generate is not None
    ok, _ = judge(worst_perplexity(p, baseline), baseline.quality.perplexity, tol, False, baseline.policy)
    ci = gain(p.generate, baseline.generate, objective)
    verdict = Verdict.OUTSIDE if not ok else Verdict.UNTIMED if ci is None else \
        Verdict.WITHIN if trusted_gain(ci) else Verdict.NO_GAIN
    return replace(p, verdict=verdict, gain=ci)


def worst_perplexity(p: GeneratePolicy, baseline: GeneratePolicy) -> float:
    """The perplexity a policy is judged by: its interval's upper end where it has one (within tolerance only when
    the interval says so), its own where not."""
    assert p.quality is not None and baseline.quality is not None
    change = p.quality.change
    return p.quality.perplexity if change is None else baseline.quality.perplexity * (1.0 + max(change.high,
                                                                                                change.value))


def gain_text(ci: SpeedupInterval) -> str:
    return f"{ci.point:.2f}x [{ci.low:.2f}–{ci.high:.2f}]"


def _chosen_sentence(best: GeneratePolicy, base: str, tol: Tolerance, objective: str) -> str:
    assert best.gain is not None
    what = "the least energy per generated token" if objective_of(objective).counts_joules else \
        f"the fastest for {objective}"
    change = best.quality.perplexity_change if best.quality is not None else None
    interval = best.quality.change if best.quality is not None else None
    said = "" if change is None else f" ({change:+.2%}" + (
        f", 95% interval {interval.low:+.2%} to {interval.high:+.2%})" if interval is not None else ")")
    return (f"{best.policy}: {what} ({gain_text(best.gain)} {base}'s, {best.gain.rounds} paired rounds) with "
            f"perplexity within {tol} of {base}" + said)


def _kept_sentence(base: str, tol: Tolerance, objective: str, judged: list[GeneratePolicy]) -> str:
    what = objective_of(objective).gain[2] if objective_of(objective).counts_joules else f"was faster for {objective}"
    untimed = [p.policy for p in judged if p.verdict == Verdict.UNTIMED]
    return (f"{base}: no policy within {tol} of its perplexity {what} beyond doubt (a paired interval wholly above "
            f"{1 + MIN_GAIN:.2f}x)" + (f"; not timed: {', '.join(untimed)}" if untimed else ""))


def steadiness_notes(policies: list[GeneratePolicy], objective: str) -> list[str]:
    """What a reader must know of the timings' evidence: the policies timed beside a busy process, and those whose
    rounds' times spread past UNSTEADY."""
    timed = [(p.policy, p.generate) for p in policies if p.status == "ok" and p.generate is not None]
    busy = [name for name, g in timed if g.disturbed_runs]
    notes = [f"other processes took the CPU while {', '.join(busy)} {'was' if len(busy) == 1 else 'were'} timed: "
             "those rounds are left out of the pairing while enough quiet ones remain, and a gain resting on one is "
             "no gain (rerun on a quiet machine)"] if busy else []
    spread = []
    for name, g in timed:
        runs = round_seconds(g, objective)
        if runs and min(runs) > 0 and math.isfinite(max(runs)) and max(runs) / min(runs) > UNSTEADY:
            spread.append(f"{name} {max(runs) / min(runs):.1f}x")
    if spread:
        notes.append(f"unsteady timings (slowest over fastest round): {', '.join(spread)}")
    return notes


__all__ = ["Judged", "gain", "gain_text", "judge_generation", "objective_value", "round_seconds", "steadiness_notes",
           "trusted_gain"]
