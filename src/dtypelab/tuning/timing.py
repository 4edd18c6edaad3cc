"""Paired timing for the search: two callables timed in alternation on warm state, so that drift over a search
that takes minutes (turbo, other tenants) hits both alike and ratios stay comparable between evaluations.

Each measurement is watched for other processes (``CpuMeter``) and taken again, up to RETRIES times, while they
disturb it; the ratio comes with a 95% interval over the timed pairs, and a plan counts as faster only when its
whole interval clears the no-gain band, as in ``bench``."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtypelab.core.disturbance import CpuMeter, describe
from dtypelab.core.measure import StepTimer, device_sync
from dtypelab.core.stats import Interval, ratio_interval

REPS = 11  # timed pairs per measurement (after two warm-ups each); the medians are kept
RETRIES = 2  # measurements taken again while other processes disturb them


@dataclass(frozen=True)
class Paired:
    base_s: float  # median seconds of the base callable
    other_s: float  # ... of the other one
    interval: Interval | None  # base / other over the timed pairs
    disturbed: str = ""  # what other processes did, when they disturbed even the last attempt

    @property
    def speedup(self) -> float:
        return self.base_s / self.other_s if self.other_s > 0 else 0.0


def paired(base: Callable[[], Any], other: Callable[[], Any], device: torch.device, reps: int = REPS,
           grad: bool = False, retries: int = RETRIES) -> Paired:
    """``base`` and ``other`` timed in alternation, ``grad`` for training steps (else no_grad)."""
    for _ in range(retries + 1):
        timers = (StepTimer(sync=device_sync(device)), StepTimer(sync=device_sync(device)))
        meter = CpuMeter()
        with contextlib.nullcontext() if grad else torch.no_grad():
            for fn in (base, other, base, other):
                fn()
            meter.start()
            for _ in range(reps):
                for fn, timer in zip((base, other), timers, strict=True):
                    timer.start()
                    fn()
                    timer.stop()
            busy = meter.stop()
        if busy is None or not busy.disturbed:
            busy = None
            break
    b, o = timers[0].samples, timers[1].samples
    return Paired(statistics.median(b), statistics.median(o), ratio_interval(list(zip(b, o, strict=True))),
                  describe(busy) if busy is not None else "")
