"""What Lightning's and Hugging Face's integrations call on a session (``dtypelab.lightning``, ``dtypelab.hf``): the
metrics they log, the model they converted themselves, the samples and loss of each step, the end of the run. A mixin
of ``script.handle.Session``, whose state it reads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtypelab.core.loop import fingerprint
from dtypelab.core.task import tensors


class Integrations:
    """The session's side of a framework's callbacks."""

    def record_metrics(self, metrics: dict[str, Any], higher_is_better: bool | None = None,
                       primary: str | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if _number(v)}
        if not clean:
            return
        self._metrics.update(clean)
        self._metric = primary if primary in clean else (self._metric or next(iter(clean)))
        if higher_is_better is not None:
            self._higher = higher_is_better

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def attach(self, model: nn.Module) -> None:
        """A model the framework converted itself (Lightning, Hugging Face): sized and fingerprinted, and the
        memory window opened, as ``setup`` does."""
        refused = self.diag.refuses_framework()
        if refused:
            self.unsupported(refused)
        self._framework = True
        if self._model is None:
            self._init = fingerprint(model)
            self._model = model
            self.meter.open_window()

    def count_samples(self, batch: Any) -> None:
        """A framework's training batch: its leading dimension is added to this step's samples."""
        self._samples += _leading(batch)

    def add_samples(self, n: int) -> None:
        """Samples in this step, when a framework knows them without a batch to look at."""
        self._samples += int(n)

    def record_loss(self, value: float) -> None:
        """One step's loss, as a framework logged it."""
        self.losses.append(float(value))

    def close(self) -> None:
        """Write the result now (integrations: at the end of fit, with the metrics recorded so far)."""
        self._close()


def _leading(batch: Any) -> int:
    """The batch size of a batch or a forward call's arguments: the leading dimension of the first tensor with
    one, however nested (a dict batch, a tuple of tensors)."""
    return next((int(t.shape[0]) for t in tensors(batch) if t.dim() > 0), 0)


def _number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
