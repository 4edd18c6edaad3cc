"""The calibration data a calibrated quantization method reads while a model is converted (GPTQ's Hessians, AWQ's
activation scales), set around ``Precision.convert_module`` by whoever has the data and read by the kind that needs
it, then restored. Either token ids (a language model's windows: ``bench --mode generate``, ``tune --mode
generate``, ``export``) or a feed, a function that runs the model on the task's own inputs (``bench --mode
infer``, ``tune --mode infer``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

Feed = Callable[[Any], None]  # runs the model (its calibration inputs through it)
_FEED: ContextVar[Feed | None] = ContextVar("dtypelab_calibration", default=None)
WINDOWS_PER_CALL = 8


def windows_feed(ids: torch.Tensor) -> Feed:
    """Token windows (windows × tokens) through a causal language model, a few at a time."""
    def feed(model: Any) -> None:
        device = next((p.device for p in model.parameters()), ids.device)
        for i in range(0, len(ids), WINDOWS_PER_CALL):
            model(ids[i:i + WINDOWS_PER_CALL].to(device))
    return feed


def task_feed(inputs: Any) -> Feed:
    """A task's inference inputs (a tensor, args or kwargs) through its model, their floats in its weights' dtype (a
    model converted mid-way: the cast done, the regions not yet wrapped)."""
    def feed(model: Any) -> None:
        from dtypelab.core.task import call_model, map_tensors  # the task module imports the policies: not above

        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        call_model(model, map_tensors(lambda t: t.to(dtype) if dtype and t.is_floating_point() else t, inputs))
    return feed


@contextmanager
def calibrating(data: torch.Tensor | Feed | None) -> Iterator[None]:
    """While open, ``calibration()`` gives a feed of ``data`` (token ids, or a feed already)."""
    feed = windows_feed(data) if isinstance(data, torch.Tensor) else data
    token = _FEED.set(feed)
    try:
        yield
    finally:
        _FEED.reset(token)


def calibration() -> Feed | None:
    return _FEED.get()


__all__ = ["Feed", "calibrating", "calibration", "task_feed", "windows_feed"]
