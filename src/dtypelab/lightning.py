"""dtypelab for Lightning: ``trainer = dtypelab.lightning.Trainer(..., metric="val_acc")`` in place of
``L.Trainer(...)`` — the one changed line. Run normally it is Lightning's Trainer as given; run by ``dtypelab
bench train.py``, its ``precision=`` is the policy's own Lightning value and a callback times each training batch
(after it is loaded, to the end of its optimizer step), records the loss and the validation metrics."""

from __future__ import annotations

from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import TF32, Autocast, Cast, Plan
from dtypelab.script import Session

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - the [lightning] extra
    raise DtypelabError("dtypelab.lightning needs Lightning: pip install 'dtypelab[lightning]'") from exc

# dtypelab's configs as Lightning's precision= values
_CAST = {"float64": "64-true", "float32": "32-true", "bfloat16": "bf16-true", "float16": "16-true"}
_MIXED = {"bfloat16": "bf16-mixed", "float16": "16-mixed"}


def lightning_precision(plan: Plan) -> str:
    """The ``precision=`` value Lightning runs this policy with; an error for what Lightning cannot express."""
    c = plan.default
    if not plan.rules:
        if isinstance(c, Cast) and c.dtype in _CAST:
            return _CAST[c.dtype]
        if isinstance(c, Autocast) and c.dtype in _MIXED:
            return _MIXED[c.dtype]
        if isinstance(c, TF32):
            return "32-true"  # with the TF32 matmul flags, set by the session for the whole run
    raise DtypelabError(f"policy {plan.name} has no Lightning precision (Lightning runs 64/32/bf16/16 true and "
                        "bf16/16 mixed)")


class DtypelabCallback(pl.Callback):
    """Times each training batch, records its loss and the logged metrics into the session."""

    def __init__(self, lab: Session, metric: str | None, higher_is_better: bool | None) -> None:
        self.lab, self.metric, self.higher = lab, metric, higher_is_better

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.lab.attach(pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lab.step_begin()
        self.lab.count_samples(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.lab.step_end(float(loss.detach()) if loss is not None else None)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._metrics(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._metrics(trainer)
        if self.lab.driven and self.metric and self.metric not in self.lab.metrics:
            raise DtypelabError(f"metric {self.metric!r} was never logged; logged: {sorted(trainer.callback_metrics)}")
        self.lab.close()

    def _metrics(self, trainer: Any) -> None:
        logged = {k: v for k, v in trainer.callback_metrics.items() if not self.metric or k == self.metric}
        self.lab.record_metrics(logged, self.higher, primary=self.metric)


def Trainer(*args: Any, metric: str | None = None, higher_is_better: bool | None = None,
            seed: int | None = None, **kwargs: Any) -> pl.Trainer:
    """``lightning.pytorch.Trainer(*args, **kwargs)`` measured by dtypelab. ``metric``: the logged metric to
    judge policies by (default: the first one logged); whether higher is better is guessed from its name unless
    given. It touches no global state of the script's (``seed`` is accepted for old scripts and ignored): run by
    dtypelab, each policy's process is seeded before the script starts, and ``L.seed_everything`` in the script
    holds."""
    lab = Session(seed=seed)
    if lab.driven:
        kwargs["precision"] = lightning_precision(lab.plan)
        kwargs.setdefault("accelerator", "gpu" if lab.device.type == "cuda" else "cpu")
    callbacks = list(kwargs.get("callbacks") or [])
    kwargs["callbacks"] = [*callbacks, DtypelabCallback(lab, metric, higher_is_better)]
    return pl.Trainer(*args, **kwargs)
