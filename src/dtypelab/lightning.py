"""dtypelab for Lightning: ``trainer = dtypelab.lightning.Trainer(..., metric="val_acc")`` in place of
``L.Trainer(...)`` — the one changed line. Run normally it is Lightning's Trainer as given; run by ``dtypelab
bench train.py``, its ``precision=`` is the policy's own Lightning value (or, for a policy Lightning has none for, the
kinds' own hooks as a precision plugin) and a callback times each training batch
(after it is loaded, to the end of its optimizer step), records the loss and the validation metrics."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Plan
from dtypelab.script import LIGHTNING_PRECISION, Session

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - the [lightning] extra
    raise DtypelabError("dtypelab.lightning needs Lightning: pip install 'dtypelab[lightning]'") from exc

def lightning_precision(plan: Plan) -> str | None:
    """The ``precision=`` value Lightning runs this policy with (``LIGHTNING_PRECISION`` of its kind), or None when
    Lightning has none (a per-module plan, an optimizer-state modifier, a kind of your own): ``DtypelabPrecision``
    runs it then."""
    return None if plan.rules or plan.state is not None else LIGHTNING_PRECISION(plan.default)


class DtypelabPrecision(pl.plugins.Precision):
    """A policy Lightning has no ``precision=`` value for, run through dtypelab's own hooks (its kinds'): the
    module converted, the forward under its context, its loss scaling, the optimizers converted and stepped."""

    def __init__(self, lab: Session) -> None:
        self.lab, self.hooks = lab, lab.precision

    def convert_module(self, module: Any) -> Any:
        return self.hooks.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.hooks.convert_input(data)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with self.hooks.forward_context():
            yield

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        return model, [self.hooks.convert_optimizer(o, model) for o in optimizers], lr_schedulers

    def pre_backward(self, tensor: Any, module: Any) -> Any:
        scaler = self.hooks.grad_scaler()
        return super().pre_backward(scaler.scale(tensor) if scaler is not None else tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        closure = functools.partial(self._wrap_closure, model, optimizer, closure)
        if self.hooks.grad_scaler() is None:  # a kind's own step runs the closure first (Precision.step)
            result = self.hooks.step(optimizer, closure)
        else:  # as Lightning's own MixedPrecision: the closure first, GradScaler's step on its gradients
            result = closure()
            self.hooks.step(optimizer)
        self.hooks.update()
        return result


class DtypelabCallback(pl.Callback):
    """Times each training batch, records its loss and the logged metrics into the session."""

    def __init__(self, lab: Session, metric: str | None, higher_is_better: bool | None) -> None:
        self.lab, self.metric, self.higher = lab, metric, higher_is_better

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.lab.frameworks.attach(pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lab.step_begin()
        self.lab.frameworks.count_samples(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.lab.step_end(float(loss.detach()) if loss is not None else None)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._metrics(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._metrics(trainer)
        if self.lab.driven and self.metric and self.metric not in self.lab.frameworks.metrics:
            raise DtypelabError(f"metric {self.metric!r} was never logged; logged: {sorted(trainer.callback_metrics)}")
        self.lab.frameworks.close()

    def _metrics(self, trainer: Any) -> None:
        logged = {k: v for k, v in trainer.callback_metrics.items() if not self.metric or k == self.metric}
        self.lab.frameworks.record_metrics(logged, self.higher, primary=self.metric)


def Trainer(*args: Any, metric: str | None = None, higher_is_better: bool | None = None,
            seed: int | None = None, **kwargs: Any) -> pl.Trainer:
    """``lightning.pytorch.Trainer(*args, **kwargs)`` measured by dtypelab. ``metric``: the logged metric to
    judge policies by (default: the first one logged); whether higher is better is guessed from its name unless
    given. It touches no global state of the script's (``seed`` is accepted for old scripts and ignored): run by
    dtypelab, each policy's process is seeded before the script starts, and ``L.seed_everything`` in the script
    holds."""
    lab = Session(seed=seed)
    if lab.driven:
        value = lightning_precision(lab.plan)
        if value is not None:
            kwargs["precision"] = value
        else:
            kwargs.pop("precision", None)
            kwargs["plugins"] = [*(kwargs.get("plugins") or []), DtypelabPrecision(lab)]
        kwargs.setdefault("accelerator", "gpu" if lab.device.type == "cuda" else "cpu")
    callbacks = list(kwargs.get("callbacks") or [])
    kwargs["callbacks"] = [*callbacks, DtypelabCallback(lab, metric, higher_is_better)]
    return pl.Trainer(*args, **kwargs)
