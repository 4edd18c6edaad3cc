"""What Lightning's and Hugging Face's integrations call on a session (``dtypelab.lightning``, ``dtypelab.hf``, as
``lab.frameworks``): the metrics they log, the model they converted themselves, the samples and loss of each step,
the end of the run. A part of ``script.handle.Session``: it writes the run's and the step's state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtypelab.core.loop import fingerprint
from dtypelab.core.task import tensors


class Frameworks:
    """The session's side of a framework's callbacks."""

    def __init__(self, lab: Any) -> None:  # the Session (script.handle), which composes this part
        self.lab, self.run, self.step = lab, lab.run_state, lab.step_state

    def record_metrics(self, metrics: dict[str, Any], higher_is_better: bool | None = None,
                       primary: str | None = None) -> None:
        record_metrics(self.run, metrics, higher_is_better, primary)

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.run.metrics)

    def attach(self, model: nn.Module, optimizer: Any = None) -> None:
        """A model the framework converted itself (Lightning, Hugging Face): sized and fingerprinted, and the
        memory window opened, as ``setup`` does; ``optimizer``, one it made and steps itself, whose state the
        memory breakdown counts (accelerate's wrapper: the optimizer inside it)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer) and all(inner is not o for o in self.run.watched):
            self.run.watched.append(inner)
        refused = self.lab.diag.refuses_framework()
        if refused:
            self.lab.unsupported(refused)
        self.run.framework = True
        if self.run.model is None:
            self.run.init = fingerprint(model)
            self.run.model = model
            self.lab.open_memory_window()

    def count_samples(self, batch: Any) -> None:
        """A framework's training batch: its leading dimension is added to this step's samples."""
        self.step.samples += _leading(batch)

    def add_samples(self, n: int) -> None:
        """Samples in this step, when a framework knows them without a batch to look at."""
        self.step.samples += int(n)

    def record_loss(self, value: float) -> None:
        """One step's loss, as a framework logged it."""
        self.lab.losses.append(float(value))

    def close(self) -> None:
        """Write the result now (integrations: at the end of fit, with the metrics recorded so far)."""
        self.lab.close()


def record_metrics(run: Any, metrics: dict[str, Any], higher_is_better: bool | None = None,
                   primary: str | None = None) -> None:
    """The numbers among ``metrics`` kept in the run (the primary one: ``primary``, else the first ever given)."""
    clean = {k: float(v) for k, v in metrics.items() if _number(v)}
    if not clean:
        return
    run.metrics.update(clean)
    run.metric = primary if primary in clean else (run.metric or next(iter(clean)))
    if higher_is_better is not None:
        run.higher = higher_is_better


def _leading(batch: Any) -> int:
    """The batch size of a batch or a forward call's arguments: the leading dimension of the first tensor with
    one, however nested (a dict batch, a tuple of tensors)."""
    return next((int(t.shape[0]) for t in tensors(batch) if t.dim() > 0), 0)


def _number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
