"""Paired timing for the search: two callables timed in alternation on warm state, so that drift over a search
that takes minutes (turbo, other tenants) hits both alike and ratios stay comparable between evaluations."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from typing import Any

import torch

from dtypelab.core.measure import StepTimer, device_sync

REPS = 11  # timed pairs per measurement (after two warm-ups each); the medians are kept


def paired(base: Callable[[], Any], other: Callable[[], Any], device: torch.device, reps: int = REPS,
           grad: bool = False) -> tuple[float, float]:
    """(median seconds of ``base``, of ``other``), interleaved; ``grad`` for training steps (else no_grad)."""
    timers = (StepTimer(sync=device_sync(device)), StepTimer(sync=device_sync(device)))
    with contextlib.nullcontext() if grad else torch.no_grad():
        for fn in (base, other, base, other):
            fn()
        for _ in range(reps):
            for fn, timer in zip((base, other), timers, strict=True):
                timer.start()
                fn()
                timer.stop()
    return statistics.median(timers[0].samples), statistics.median(timers[1].samples)
