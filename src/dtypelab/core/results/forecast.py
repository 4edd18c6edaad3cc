"""Forecast records: each policy's peak memory and step time, traced without running, for a device
(``dtypelab forecast``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.results.energy import Energy
from dtypelab.core.results.memory import MEMORY_CATEGORIES
from dtypelab.core.results.store import Record

FORECAST_SCHEMA = "dtypelab.forecast"
# 2: each policy's predicted time, the baseline and the fastest policy that fits; 3: each policy's energy
FORECAST_VERSION = 3
PEAK_CATEGORIES = MEMORY_CATEGORIES  # the peak's categories, in the order they are shown
METHODS = {
    "traced": "traced on fake tensors",
    "stand-in": "traced with a stand-in storing the same layout, for a conversion or kernel this machine lacks (a cast "
                "with the converted weights' bytes from their format's layout, or the format's emulation)",
    "measured": "measured here on small batches and extrapolated (the step could not be traced)",
    "state-only": "the state traced alone (the step could not be traced, nor run here): activations not counted",
}


@dataclass(frozen=True)
class TargetDevice:
    """What the forecast is for: a GPU from the table, this machine's device, or a memory size."""

    name: str  # "H100", "cpu", "24GiB", "" (none: peaks only)
    label: str  # "NVIDIA H100 80GB"
    kind: str  # "cuda" or "cpu": whose allocator and optimizer defaults the trace follows
    memory_bytes: int | None = None  # what a program can use (None: no limit asked)
    reserve_bytes: int = 0  # kept aside, not traced: the CUDA context and libraries' workspaces
    source: str = ""  # where the memory figure comes from
    capability: tuple[int, int] | None = None  # CUDA compute capability, where known

    @property
    def usable_bytes(self) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes - self.reserve_bytes


@dataclass(frozen=True)
class PeakForecast:
    """One forward-and-backward-and-update step's (or one inference pass's) peak, per rank."""

    batch_size: int  # per rank
    peak_bytes: int
    breakdown: dict[str, int]  # PEAK_CATEGORIES at the peak; they add up to peak_bytes
    phase: str  # batch, forward, backward or optimizer
    module: str = ""  # the innermost module running at the peak ("" outside any, or not known)
    activations_bytes: int | None = None  # the most the forward kept for the backward at once (training)
    parameter_bytes: int = 0  # the parameters' exact bytes (their storages, each once)


@dataclass(frozen=True)
class FitForecast:
    """Whether the peak fits the target's usable memory, with what is left, and the largest batch that fits."""

    fits: bool
    headroom_bytes: int  # usable − peak (negative: short by that much)
    largest_batch: int | None = None  # global (all ranks); None: not even the smallest fits
    capped: bool = False  # ``largest_batch`` is the search's cap: more may fit
    traces: int = 0  # the traces the search took


@dataclass(frozen=True)
class CheckResult:
    """``--check``: the same step run here on real tensors."""

    steps: int
    train_peak_bytes: int | None = None  # the ledger on real tensors, over ``steps`` steps
    infer_peak_bytes: int | None = None
    process_peak_bytes: int | None = None  # as bench measures it (peak RSS on a CPU, max_memory_allocated on CUDA)
    process_method: str = ""
    note: str = ""


@dataclass(frozen=True)
class TimeForecast:
    """One training step's (or inference pass's) predicted time per rank on the target (``core.machine.speed``)."""

    step_s: float | None  # None: no prediction (``reason`` says why)
    speedup: float | None = None  # the baseline's step over this one's
    bound: str = ""  # compute, memory or overhead: what most of the time is bound by
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per group (matmuls, attention, ...)
    bounds: dict[str, float] = field(default_factory=dict)  # seconds per bound
    kernels: int = 0
    reason: str = ""  # why there is none, or what to keep in mind about it (a stand-in's kernels)
    measured_s: float | None = None  # --check: the same step timed here (median)
    measured_speedup: float | None = None  # --check: the baseline's measured step over this one's
    # what other processes did while this machine's kernels (or --check's steps) were timed, when they stayed busy
    # through every round: then its time and speedup are not reliable and no fastest policy is named ("" if quiet)
    disturbed: str = ""


@dataclass(frozen=True)
class PolicyForecast:
    policy: str
    summary: str
    status: str  # ok, skipped, failed
    method: str = ""  # a METHODS key
    reason: str = ""  # why skipped or failed
    notes: tuple[str, ...] = ()
    train: PeakForecast | None = None
    infer: PeakForecast | None = None
    train_fit: FitForecast | None = None
    infer_fit: FitForecast | None = None
    runs_there: str = ""  # why the target device cannot run this policy ("": it can, or no device)
    smallest_device: str | None = None  # no device named: the smallest GPU of the table the training peak fits
    check: CheckResult | None = None
    seconds: float = 0.0
    time: TimeForecast | None = None
    energy: Energy | None = None  # the step's energy on the target: its time at the power model's watts

    @property
    def peak(self) -> PeakForecast | None:
        """The peak that decides: training's, else inference's."""
        return self.train or self.infer

    @property
    def untraced(self) -> bool:
        """Its step could not be traced nor run here: its peak counts the state alone (a lower bound), and it has
        no fit and no time."""
        return self.method == "state-only"


@dataclass(frozen=True)
class ForecastConfig:
    task: str
    task_name: str
    batch_size: int  # global, as the task's loop takes it
    nproc: int
    seed: int
    device: TargetDevice
    parameters: int = 0  # the model's parameter count (each once)
    infer_batch_size: int = 0
    mode: str = "train"  # train (and the inference peak), or infer (an inference-only task)


@dataclass(frozen=True)
class ForecastReport(Record):
    config: ForecastConfig
    policies: tuple[PolicyForecast, ...]
    environment: dict[str, Any] = field(default_factory=dict)
    answer: str = ""  # the forecast in a sentence: what fits, or the smallest peak when nothing does
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    created: str = ""
    baseline: str = ""  # the policy speedups are against
    rates: str = ""  # where the time model's rates come from (datasheet, measured here)
    fastest: str = ""  # the fastest policy predicted to fit ("" when no time was forecast)
    speed_answer: str = ""  # that answer in a sentence
    # the error the validation supports for a predicted speedup (0.15: ±15%; 0 in records written before): each
    # speedup's band, and predictions whose bands overlap are a tie (``forecasting.timing.speedup_error``)
    speed_error: float = 0.0
    energy_note: str = ""  # the power model the energy comes from, or why there is none
    # the bands of each peak and each step's joules, from the validation set's held-out cases (core.bands; 0: none
    # claimed, as in records written before)
    memory_error: float = 0.0
    energy_error: float = 0.0
    step_error: float = 0.0  # a step's absolute time (samples a second): its band, wider than a speedup's

    schema_version: int = FORECAST_VERSION

    schema = FORECAST_SCHEMA
    version = FORECAST_VERSION

    def result(self, policy: str) -> PolicyForecast:
        for p in self.policies:
            if p.policy == policy:
                return p
        raise KeyError(policy)


def _migrate_v1(d: dict[str, Any]) -> dict[str, Any]:
    """Version 1 forecast memory only: no policy has a time, and there is no baseline or fastest policy."""
    return {**d, "baseline": "", "rates": "", "fastest": "", "speed_answer": ""}


ForecastReport.migrations = {1: _migrate_v1, 2: lambda d: d}  # version 2 had no energy: nothing to fill
