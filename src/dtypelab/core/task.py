"""What to train and evaluate: the Task record and how to load one by name or path."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import TaskError, describe_exception

Batch = Any  # a Tensor, or a tuple/list/dict of Tensors passed to the model as *args / **kwargs
Predict = Callable[[Batch], Any]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


@dataclass(frozen=True)
class Task:
    """Everything dtypelab needs to train and judge a model.

    ``train_batch(step, batch_size)`` must be deterministic in ``step`` so that every policy sees the
    same data in the same order. ``evaluate(predict)`` receives a function that runs the model under
    the policy being measured (inputs converted, outputs returned as float32) and returns metrics;
    ``metric`` names the primary one.
    """

    name: str
    make_model: Callable[[], nn.Module]
    train_batch: Callable[[int, int], tuple[Batch, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    evaluate: Callable[[Predict], Mapping[str, float]]
    metric: str
    higher_is_better: bool
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    steps: int = 200
    batch_size: int = 64
    infer_batch: Callable[[int], Batch] | None = None
    pretrained: bool = False  # the factory returns trained weights: inference mode skips training
    inference_only: bool = False  # nothing to train on (e.g. a shipped pretrained model)
    description: str = ""
    # (file, first line of the function, line) of the code that built this Task: trace points there when a
    # library function (loss_fn=F.mse_loss) rather than a line of the user's runs the op at fault.
    origin: tuple[str, int, int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.origin is None:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith("<") or
                                         frame.f_code.co_filename == __file__):
                frame = frame.f_back  # the dataclass's generated __init__, then this file
            if frame is not None:
                object.__setattr__(self, "origin", (frame.f_code.co_filename, frame.f_code.co_firstlineno,
                                                    frame.f_lineno))
        for name in ("make_model", "train_batch", "loss_fn", "evaluate", "make_optimizer"):
            if not callable(getattr(self, name)):
                raise TaskError(f"task {self.name!r}: {name} must be callable")
        if not self.metric:
            raise TaskError(f"task {self.name!r}: metric must name the primary metric")
        if self.steps < 1 or self.batch_size < 1:
            raise TaskError(f"task {self.name!r}: steps and batch_size must be positive")

    def inference_inputs(self, batch_size: int) -> Batch:
        if self.infer_batch is not None:
            return self.infer_batch(batch_size)
        return self.train_batch(0, batch_size)[0]


BUILTIN = {
    "digits": "dtypelab.core.tasks.digits:make_task",
    "checkerboard": "dtypelab.core.tasks.checkerboard:make_task",
    "charlm": "dtypelab.core.tasks.charlm:make_task",
    "minilm": "dtypelab.core.tasks.minilm:make_task",  # optional extra: dtypelab[minilm]
}


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise TaskError(f"task file not found: {path}")
    name = "dtypelab_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise TaskError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise TaskError(f"importing {path} failed: {describe_exception(exc)}") from exc
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise TaskError(f"no module named {name!r}") from exc
        raise TaskError(f"importing {name} failed: {describe_exception(exc)}") from exc
    except Exception as exc:
        raise TaskError(f"importing {name} failed: {describe_exception(exc)}") from exc


def resolve_spec(spec: str) -> str:
    """Built-in name -> its module spec; anything else is returned as given."""
    return BUILTIN.get(spec, spec)


def load_task(spec: str) -> Task:
    """Load a task from a built-in name, ``path/file.py:make_task`` or ``pkg.module:make_task``."""
    target = resolve_spec(spec)
    if ":" not in target:
        if target.endswith(".py"):
            target += ":make_task"
        else:
            close = difflib.get_close_matches(spec, BUILTIN, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TaskError(
                f"unknown task {spec!r}{hint}: use a built-in ({', '.join(BUILTIN)}), "
                "path/file.py:make_task or pkg.module:make_task"
            )
    where, _, attr = target.rpartition(":")
    module = _import_file(where) if where.endswith(".py") or os.sep in where else _import_module(where)
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TaskError(f"{where} has no attribute {attr!r}{hint}")
    if isinstance(factory, Task):
        return factory
    if not callable(factory):
        raise TaskError(f"{where}:{attr} is neither a Task nor a function returning one")
    try:
        task = factory()
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"{where}:{attr}() raised {describe_exception(exc)}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"{where}:{attr}() returned {type(task).__name__}, expected dtypelab.Task")
    return task


def call_model(model: nn.Module, inputs: Batch) -> Any:
    """Call a model with a batch given as a tensor, a tuple/list of args, or a dict of kwargs."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply fn to every tensor in a nested tuple/list/dict."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj
