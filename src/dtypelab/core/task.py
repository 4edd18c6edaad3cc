"""What to train and evaluate: the Task record and how to load one by name or path."""

from __future__ import annotations

import ast
import dataclasses
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
    same data in the same order. It returns ``(inputs, target)`` for ``loss_fn(model(inputs), target)``, or,
    with ``compute_loss(model, batch)`` instead of ``loss_fn`` (a loss computed inside the model, as every
    Hugging Face model does, or a ``training_step``-style function), any batch that function takes.
    ``evaluate(predict)`` receives a function that runs the model under the policy being measured (inputs
    converted, floating outputs returned as float32 on the CPU, dataclass / ModelOutput outputs kept as their
    type) and returns metrics; ``metric`` names the primary one. A pretrained model that is never trained is
    an ``InferenceTask(...)``: no training fields at all.
    """

    name: str
    make_model: Callable[[], nn.Module]
    train_batch: Callable[[int, int], Any] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    evaluate: Callable[[Predict], Mapping[str, float]] | None = None
    metric: str = ""
    higher_is_better: bool = True
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    steps: int = 200
    batch_size: int = 64
    infer_batch: Callable[[int], Batch] | None = None
    pretrained: bool = False  # the factory returns trained weights: inference mode skips training
    inference_only: bool = False  # nothing to train on (e.g. a shipped pretrained model)
    description: str = ""
    compute_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None  # instead of loss_fn: loss from the batch
    # a model of ``blocks`` identical blocks, and its factory at any number of them (an hf: language model): a
    # forecast traces one and two and reads every quantity off the line through them
    # the loss's inputs (last hidden states, output projection, targets) for a loss choice (``+chunked-ce``,
    # ``policies.loss``): a language model's; None: the task's loss is the only one
    head_inputs: Callable[[nn.Module, Any], Any] | None = field(default=None, compare=False, repr=False)
    blocks: int = 0
    with_blocks: Callable[[int], nn.Module] | None = field(default=None, compare=False, repr=False)
    # (file, first line of the function, line) of the code that built this Task: trace points there when a
    # library function (loss_fn=F.mse_loss) rather than a line of the user's runs the op at fault.
    origin: tuple[str, int, int] | None = field(default=None, compare=False, repr=False)
    # a causal language model served (``bench``/``forecast --mode generate``): ``text(n, length)`` gives n held-out
    # sequences of token ids (real text: prompts and the perplexity come from them); ``context``: its positions
    text: Callable[[int, int], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    context: int = 0

    def __post_init__(self) -> None:
        if self.origin is None:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith("<") or
                                         frame.f_code.co_filename == __file__):
                frame = frame.f_back  # the dataclass's generated __init__, then this file
            if frame is not None:
                object.__setattr__(self, "origin", (frame.f_code.co_filename, frame.f_code.co_firstlineno,
                                                    frame.f_lineno))
        required = ["make_model", "evaluate"]
        if not self.inference_only:
            required.append("train_batch")
            if self.loss_fn is not None and self.compute_loss is not None:
                raise TaskError(f"task {self.name!r}: give loss_fn or compute_loss, not both")
            required.append("compute_loss" if self.compute_loss is not None else "loss_fn")
        elif self.infer_batch is None and self.train_batch is None:
            raise TaskError(f"task {self.name!r}: an inference-only task needs infer_batch(batch_size)")
        for name in [*required, "make_optimizer"]:
            if not callable(getattr(self, name)):
                raise TaskError(f"task {self.name!r}: {name} must be callable"
                                + (" (or give compute_loss(model, batch))" if name == "loss_fn" else ""))
        if not self.metric:
            raise TaskError(f"task {self.name!r}: metric must name the primary metric")
        if self.steps < 1 or self.batch_size < 1:
            raise TaskError(f"task {self.name!r}: steps and batch_size must be positive")

    def batch(self, step: int, batch_size: int) -> tuple[Any, Any]:
        """(inputs, target) for step ``step``: with ``compute_loss`` the whole batch and None."""
        got = self.train_batch(step, batch_size)
        if self.compute_loss is not None:
            return got, None
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise TaskError(f"task {self.name!r}: train_batch must return (inputs, target) for loss_fn, got "
                            f"{type(got).__name__}; a task whose batch is one structure gives compute_loss instead")
        return got[0], got[1]

    def inference_inputs(self, batch_size: int) -> Batch:
        if self.infer_batch is not None:
            return self.infer_batch(batch_size)
        return self.batch(0, batch_size)[0]


def InferenceTask(name: str, make_model: Callable[[], nn.Module], infer_batch: Callable[[int], Batch],
                  evaluate: Callable[[Predict], Mapping[str, float]], metric: str, higher_is_better: bool = True,
                  *, batch_size: int = 32, steps: int = 20, description: str = "", pretrained: bool = True) -> Task:
    """A task that is only run, never trained (a pretrained model): ``bench --mode infer`` needs the model,
    its inputs, and how to score its outputs; ``steps`` is its default number of timed forward passes.
    ``pretrained=False`` for a model whose factory gives untrained
    weights on purpose (its fidelity is still measured against fp32)."""
    frame = sys._getframe(1)
    return Task(name=name, make_model=make_model, infer_batch=infer_batch, evaluate=evaluate, metric=metric,
                higher_is_better=higher_is_better, batch_size=batch_size, steps=steps, description=description,
                pretrained=pretrained, inference_only=True,
                origin=(frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_lineno))


BUILTIN = {
    "digits": "dtypelab.core.tasks.digits:make_task",
    "checkerboard": "dtypelab.core.tasks.checkerboard:make_task",
    "charlm": "dtypelab.core.tasks.charlm:make_task",
    "gpt2": "dtypelab.core.tasks.gpt2:make_task",  # GPT-2-small shape on a GPU, reduced elsewhere
    "gpt2-full": "dtypelab.core.tasks.gpt2:make_full_task",  # GPT-2-small shape everywhere (forecasts, GPUs)
    "decoder": "dtypelab.core.tasks.decoder:make_task",  # a small Llama-style decoder
    "llama2-7b": "dtypelab.core.tasks.decoder:make_llama2_7b",  # Llama-2-7B's shape, no weights: for forecasts
    "tinylm": "dtypelab.core.tasks.tinylm:make_task",  # a small pretrained causal LM (serving: --mode generate)
    "minilm": "dtypelab.core.tasks.minilm:make_task",  # optional extra: dtypelab[minilm]
    "minilm-ft": "dtypelab.core.tasks.pairs:make_minilm_finetune",  # MiniLM fine-tuned on paraphrase pairs
}
HF_PREFIX = "hf:"  # hf:ORG/NAME or hf:PATH: a Hugging Face model (core.tasks.hf)


# Built-ins at a real model's full size: what a forecast is asked about, and what runs where it fits (a GPU); on
# two CPU cores a step takes seconds (gpt2-full) or more memory than there is (llama2-7b: 108 GB in float32).
FULL_SIZE = frozenset({"gpt2-full", "llama2-7b"})


def user_module_name(path: str) -> str:
    """The name a user's file is imported under (``sys.modules``: dataclasses and pickling look it up there)."""
    return "dtypelab_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")


def _import_file(path: str, what: str = "task file") -> Any:
    if not os.path.isfile(path):
        raise TaskError(f"{what} not found: {path}")
    name = user_module_name(path)
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


def import_source(where: str, what: str = "task file") -> Any:
    """A user's file (``path/file.py``) or module (``pkg.module``), imported; a one-line TaskError otherwise."""
    return _import_file(where, what) if where.endswith(".py") or os.sep in where else _import_module(where)


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


def _defines_make_task(path: str) -> bool | None:
    """Whether the file defines ``make_task`` at top level, from its syntax alone (None: it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "make_task":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "make_task" for t in node.targets):
            return True
    return False


def is_script(spec: str) -> bool:
    """A path to a .py file that defines no ``make_task``: a training script to run, not a task file to import.
    Decided from the file's syntax, without running it (a file that does not parse counts as a script: running
    it will say what is wrong, in the script's own words)."""
    if ":" in spec or not spec.endswith(".py") or not os.path.isfile(spec):
        return False
    return _defines_make_task(spec) is not True


def load_task(spec: str) -> Task:
    """Load a task from a built-in name, ``path/file.py:make_task`` or ``pkg.module:make_task``."""
    if spec.startswith(HF_PREFIX):  # imported by name, as the built-ins are: the tasks import this module
        return _import_module("dtypelab.core.tasks.hf").make_task(spec)
    target = resolve_spec(spec)
    if ":" not in target:
        if target.endswith(".py"):
            if os.path.isfile(target) and _defines_make_task(target) is False:  # refused without running it
                raise TaskError(f"{spec} defines no make_task: it is a training script, which bench, audit and trace "
                                "run as it is; this command needs a task file (README: Write your own task)")
            target += ":make_task"
        else:
            close = difflib.get_close_matches(spec, BUILTIN, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TaskError(
                f"unknown task {spec!r}{hint}: use a built-in ({', '.join(BUILTIN)}), "
                "path/file.py:make_task, pkg.module:make_task or hf:ORG/NAME (a Hugging Face model)"
            )
    where, _, attr = target.rpartition(":")
    module = import_source(where)
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
    """Apply fn to every tensor in a nested tuple/list/dict/dataclass, keeping each container's type (a
    ModelOutput stays a ModelOutput, a namedtuple a namedtuple)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:
            return type(obj)(**mapped)
        except Exception:
            return mapped  # a mapping type that cannot be rebuilt from its items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested tuple/list/dict/dataclass, in ``map_tensors``'s order."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, obj)
    return found


def plain(obj: Any) -> Any:
    """The same nested tensors in plain dicts / lists / tuples: what ``torch.load(weights_only=True)`` reads back
    (a ModelOutput or a user's dataclass is not on its allowlist)."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [plain(v) for v in obj] if isinstance(obj, list) else tuple(plain(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
