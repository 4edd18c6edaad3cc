"""A policy's energy in a record: measured here (a counter read around its timed windows) or forecast for a device
(a power model over the forecast's time). The same object in bench, generate and forecast records."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Energy:
    """Joules per step (a training step or an inference pass; a generation in serving), per sample, and per token
    where a step has tokens, with the mean power over the step; measured ones carry their interval."""

    joules_per_step: float
    joules_per_sample: float
    how: str  # measured or forecast
    by: str  # measured: the counter ("NVML total energy (NVIDIA H100 80GB HBM3)"); forecast: the model
    joules_per_token: float | None = None
    watts: float | None = None
    # measured: a 95% Student-t interval on joules per step over the windows, and how many windows
    low: float | None = None
    high: float | None = None
    windows: int = 0
    idle_watts: float | None = None  # the device doing nothing, measured apart (or the table's figure, forecast)
    # serving: per generated token over a whole generation (prefill included), and the prefill alone per prompt token
    prefill_joules_per_token: float | None = None
    decode_joules_per_token: float | None = None


@dataclass(frozen=True)
class EnergySource:
    """What measured a record's energy, or why nothing did (then no policy has an ``energy``: never a zero)."""

    counter: str = ""  # "" when nothing measured
    why: str = ""  # one line: why there is no energy (no counter here, windows too short)
    idle_watts: float | None = None
    update_s: float | None = None  # how often the counter refreshes
    min_window_s: float | None = None  # the shortest window counted


__all__ = ["Energy", "EnergySource"]
