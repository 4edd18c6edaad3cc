"""The decision a record carries: what dtypelab recommends and why, as data. A CI job reads it with
``jq .recommendation`` instead of re-running dtypelab's logic; renderers print it instead of recomputing it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Decision(str, Enum):
    """What the recommendation says, as a code."""

    USE = "use"  # use ``chosen``: measurably faster than fp32 and within every constraint
    KEEP_BASELINE = "keep-baseline"  # keep fp32: nothing was both measurably faster and within the constraints
    KEEP_BASELINE_BUSY = "keep-baseline-busy"  # busy machine, but no alternative could have won: keep fp32
    TOO_BUSY = "too-busy"  # other processes disturbed fp32's timing in a way that could change the decision
    NO_BASELINE = "no-baseline"  # fp32 did not complete: nothing to compare with
    NO_EVIDENCE = "no-evidence"  # a policy that ran was not timed: no speed verdict can be given
    NOTHING_TO_SEARCH = "nothing-to-search"  # tune: every candidate measured pathologically slow here
    NOTHING_FITS = "nothing-fits"  # --memory-budget: no policy within the constraints fits in it


class Verdict(str, Enum):
    """One policy's outcome against fp32, as a code; ``PolicyVerdict.text`` says it in words."""

    BASELINE = "baseline"
    RECOMMENDED = "recommended"
    BETTER = "better"  # its metric moved the good way (accepted)
    EQUAL = "equal"  # its metric equals fp32's (accepted)
    WITHIN = "within"  # its metric moved the bad way, within the tolerance (accepted)
    NO_GAIN = "no-gain"  # accepted, but its speedup's interval includes no gain
    OUTSIDE = "outside"  # its metric moved past the tolerance (rejected)
    NUMERICS_ONLY = "numerics-only"  # emulated (float8 training without float8 tensor cores): its metric, no speed
    OVER_MEMORY = "over-memory"  # within the tolerance, but it needs more memory than --memory-budget (rejected)
    COSINE = "cosine"  # inference: its worst output cosine is below the bound (rejected)
    DIVERGED = "diverged"  # the loss stayed non-finite
    NONFINITE = "nonfinite"  # the loss went non-finite at some step (unstable)
    NO_METRIC = "no-metric"  # it finished without a finite metric
    UNTIMED = "untimed"  # it ran, but no step was timed: no speed verdict
    SKIPPED_UNSUPPORTED = "skipped-unsupported"
    SKIPPED_SLOW = "skipped-slow"
    SKIPPED_BUDGET = "skipped-budget"
    SKIPPED_INAPPLICABLE = "skipped-inapplicable"  # the policy means nothing for this model, optimizer or script
    SKIPPED_BASELINE = "skipped-baseline"  # not run: the fp32 baseline failed (bench --keep-going runs it)
    FAILED = "failed"
    TIMEOUT = "timeout"
    OOM = "oom"
    INTERRUPTED = "interrupted"
    UNJUDGED = "unjudged"  # it ran, but fp32 did not complete: nothing to judge it against

    @property
    def settled(self) -> bool:
        """Rejected whatever its speed (the learning run's metric, cosine or loss decided): timing it again in
        paired rounds cannot change the decision."""
        return self in (Verdict.OUTSIDE, Verdict.COSINE, Verdict.NONFINITE, Verdict.NO_METRIC, Verdict.OVER_MEMORY,
                        Verdict.NUMERICS_ONLY)

    @property
    def accepted(self) -> bool:
        """Within every constraint (a policy the decision could choose)."""
        return self in (Verdict.BASELINE, Verdict.RECOMMENDED, Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN,
                        Verdict.NO_GAIN)


@dataclass(frozen=True)
class PolicyVerdict:
    """One policy as the decision saw it."""

    policy: str
    verdict: Verdict
    text: str  # the table's verdict cell: "within 1%", "cosine 0.9771 < 0.99", "diverged at step 3", ...
    speedup: float | None = None  # vs fp32: the paired rounds' geometric mean, else the medians' ratio
    speedup_low: float | None = None  # its 95% interval, from paired rounds
    speedup_high: float | None = None
    metric: float | None = None
    delta: str = ""  # the metric's change vs fp32, in the tolerance's terms ("-0.28%")
    lowest_memory: bool = False  # the lowest peak memory among the accepted policies (shown when it matters)


@dataclass(frozen=True)
class Recommendation:
    """The decision and everything said about it. ``reason`` is the decision's own sentence; ``sentences`` are
    every sentence of the explanation (the decision first), ``notes`` the table's footnotes."""

    decision: Decision
    chosen: str | None  # the policy (or plan) to use; fp32 when keeping it; None without a decision
    reason: str
    policies: tuple[PolicyVerdict, ...] = ()
    lowest_memory: str | None = None
    sentences: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> str | None:
        return self.chosen

    @property
    def undecided(self) -> bool:
        """Too disturbed to decide (``bench --strict`` exits 3)."""
        return self.decision == Decision.TOO_BUSY

    @property
    def no_evidence(self) -> bool:
        """A policy that ran was not timed, so nothing can be said of speed (``bench`` exits 1)."""
        return self.decision == Decision.NO_EVIDENCE

    @property
    def no_baseline(self) -> bool:
        """fp32 did not complete (``bench`` exits 1)."""
        return self.decision == Decision.NO_BASELINE

    @property
    def verdicts(self) -> dict[str, str]:
        """Each policy's verdict cell, by policy."""
        return {v.policy: v.text for v in self.policies}

    def verdict(self, policy: str) -> PolicyVerdict | None:
        return next((v for v in self.policies if v.policy == policy), None)
