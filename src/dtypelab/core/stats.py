"""Speed comparisons from paired timings: a geometric-mean ratio with a Student-t interval on the log ratios, and
the band a ratio must clear to count as faster. ``bench``'s interleaved rounds and ``tune``'s paired timings
decide alike with these."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

NOISY_REL_IQR = 0.10  # IQR/median above this: timings are too noisy to trust small differences


@dataclass(frozen=True)
class Summary:
    """Robust statistics of timing samples (seconds)."""

    n: int
    median: float
    q1: float
    q3: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        return self.iqr / self.median if self.median > 0 else float("inf")

    @property
    def noisy(self) -> bool:
        return self.rel_iqr > NOISY_REL_IQR


def summarize(samples: Sequence[float]) -> Summary | None:
    """Median and quartiles of samples; None when there are none."""
    if len(samples) == 0:
        return None
    q1, med, q3 = np.percentile(np.asarray(samples, dtype=np.float64), [25, 50, 75])
    return Summary(len(samples), float(med), float(q1), float(q3))


CONFIDENCE = 0.95
MIN_GAIN = 0.02  # a speedup whose interval stays above 1 + this counts as measurably faster
# A policy whose own run, and fp32's, were undisturbed and put it at or below this fraction of fp32's speed is not
# timed in the rounds: it cannot be chosen. Far below the 1.02 band because one process's timing differs from the
# next's by up to a third (charlm, EPYC Zen 4: amp-bf16 0.78x from the two runs' own medians, 1.04x in the rounds),
# so this leaves out fp64 (0.3-0.4x), not a policy near fp32.
CLEARLY_SLOWER = 0.6
MIN_QUIET = 3  # undisturbed rounds needed to leave the disturbed ones out of a paired speedup


class Interval(NamedTuple):
    point: float  # geometric mean of the ratios
    low: float
    high: float
    n: int  # ratios used


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df))


def ratio_interval(pairs: Sequence[tuple[float, float]], confidence: float = CONFIDENCE) -> Interval | None:
    """``base / other`` over paired timings (base seconds, other seconds): their geometric mean and a Student-t
    interval on the log ratios; None with fewer than two usable pairs."""
    logs = [math.log(b / o) for b, o in pairs if b > 0 and o > 0]
    if len(logs) < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t_quantile(len(logs) - 1, confidence) * sd / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A Student-t interval on the mean of independent replicates; None with fewer than two."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile(len(values) - 1, confidence) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def measurably_faster(low: float) -> bool:
    """The whole interval lies above the no-gain band."""
    return low > 1 + MIN_GAIN


def unpaired_faster(base: Sequence[float], other: Sequence[float], confidence: float = CONFIDENCE) -> bool:
    """Steps timed in separate runs (a script's policies, a sweep without rounds): ``other`` counts as faster only
    when its median beats ``base``'s by more than the no-gain band *and* a one-sided Mann-Whitney U test says its
    steps are faster at ``confidence`` (a handful of steps, or two overlapping spreads, decide nothing)."""
    if len(base) < 2 or len(other) < 2:
        return False
    if statistics.median(base) / statistics.median(other) <= 1 + MIN_GAIN:
        return False
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(other, base, alternative="less").pvalue) < 1 - confidence
