"""What a bench training run measures beyond its steps: the memory breakdown counted from the tensors and the
updates its weights lost, an emulated format's fidelity per layer, and the trained model's file size. A count that
fails loses neither the run's measurement nor the run."""

from __future__ import annotations

from typing import Any

import torch

from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import forward_loss, lost_updates, state_after, to_device
from dtypelab.core.policies import Precision
from dtypelab.core.task import Task
from dtypelab.inference import serialize
from dtypelab.sweep.adapters import emulation_fidelity

MAX_UPDATE_ROWS = 64  # parameters whose lost updates a record keeps, worst first


def model_bytes(model: Any) -> int | None:
    """The trained model's file size; None when its state cannot be written (a subclass no format takes), which
    must not lose the run's measurement."""
    try:
        return len(serialize(model)[0])
    except Exception:
        return None


def emulated_layers(task: Task, model: Any, precision: Precision, device: torch.device, batch_size: int,
                    step: int) -> list[Any]:
    """An emulated format's per-layer fidelity on one training batch (``step``'s, no update); none for any other
    plan."""
    if not precision.plan.numerics_only:
        return []
    inputs, target = to_device(task.batch(step, batch_size), device)
    with precision.session():
        return emulation_fidelity(precision.plan.configs, model,
                             lambda: forward_loss(task, model, precision, inputs, target))


def counted_state(task: Task, model: Any, precision: Precision, optimizer: Any, device: torch.device, batch_size: int,
                  steps: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]], tuple[str, ...]]:
    """The memory breakdown and the lost updates; a count that fails loses neither the measurement nor the run
    (a note says what went wrong)."""
    try:
        memory = state_after(task, model, precision, optimizer, device, batch_size, steps)
    except Exception as exc:
        return None, [], (f"the memory breakdown could not be counted ({describe_exception(exc)})",)
    try:
        return memory, lost_updates(task, model, precision, optimizer, device, batch_size,
                                    steps)[:MAX_UPDATE_ROWS], ()
    except Exception as exc:
        return memory, [], (f"its lost updates could not be counted ({describe_exception(exc)})",)


__all__ = ["MAX_UPDATE_ROWS", "counted_state", "emulated_layers", "model_bytes"]
