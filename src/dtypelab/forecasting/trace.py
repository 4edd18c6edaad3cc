"""One training step (two, so that the optimizer's state exists) or one inference forward pass of a task under a
policy, counted by the ledger: on fake tensors for the forecast, on real ones for ``--check``.

The model is built on the meta device (nothing the size of the model is allocated), converted there by the policy's
own kinds (``Precision.convert_module``: casts, regions, quantized layouts, float8 layers), then each parameter and
buffer gets a fake twin on the CPU (a quantized weight's inner tensors each get theirs). The step is the loop's own
``train_step`` through the policy's hooks, under ``FakeTensorMode`` and with ``torch.compile`` run eagerly (inductor
cannot run on fake tensors; torchao's 8-bit optimizer compiles its step). The batch is built from its shapes alone,
at any batch size, from two small real batches (``BatchShape``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from dtypelab.core.errors import TaskError, describe_exception
from dtypelab.core.loop import forward, forward_loss, train_step
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.task import Task, map_tensors
from dtypelab.forecasting.ledger import CATEGORIES, CUDA_BLOCK, Ledger, Peak


@dataclass(frozen=True)
class Target:
    """The device whose behaviour the trace follows: CUDA's caching allocator rounds each block up to 512 bytes, and
    torch's optimizers step every parameter at once there (``foreach``, their default on CUDA: its intermediates
    hold one more copy of the state being updated); on the CPU they step one parameter at a time."""

    kind: str = "cuda"

    @property
    def round_to(self) -> int:
        return CUDA_BLOCK if self.kind == "cuda" else 1

    @property
    def foreach(self) -> bool:
        return self.kind == "cuda"


# --- the batch, from its shapes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]  # at batch size 1 for the dimensions that grow (their per-sample size)
    grows: tuple[bool, ...]  # which dimensions are proportional to the batch size
    dtype: torch.dtype


@dataclass(frozen=True)
class BatchShape:
    """How a batch's tensors grow with the batch size, learnt from two small real batches: a dimension that is k·b at
    both sizes is k·b at every size; the rest stay as they are. Anything else in the batch (numbers, strings) is kept
    from the first."""

    spec: Any
    leaves: tuple[Leaf | Any, ...]

    @classmethod
    def of(cls, make: Callable[[int], Any], what: str) -> BatchShape:
        (a, spec), (b, spec_b) = tree_flatten(make(2)), tree_flatten(make(3))
        if spec != spec_b or len(a) != len(b):
            raise TaskError(f"{what} returns batches of different structure at batch sizes 2 and 3")
        leaves: list[Leaf | Any] = []
        for x, y in zip(a, b, strict=True):
            if not isinstance(x, torch.Tensor):
                leaves.append(x)
                continue
            if x.dim() != y.dim() or x.dtype != y.dtype:
                raise TaskError(f"{what}: a tensor of the batch changes rank or dtype with the batch size")
            shape, grows = [], []
            for n2, n3 in zip(x.shape, y.shape, strict=True):
                if n2 == n3:
                    shape.append(n2)
                    grows.append(False)
                elif n2 % 2 == 0 and n3 == n2 // 2 * 3:
                    shape.append(n2 // 2)
                    grows.append(True)
                else:
                    raise TaskError(f"{what}: a dimension of the batch is {n2} at batch size 2 and {n3} at 3, not in "
                                    "proportion to the batch size, so its size at another batch size is unknown")
            leaves.append(Leaf(tuple(shape), tuple(grows), x.dtype))
        return cls(spec, tuple(leaves))

    def shapes(self, batch_size: int) -> list[tuple[int, ...]]:
        return [tuple(n * batch_size if g else n for n, g in zip(leaf.shape, leaf.grows, strict=True))
                for leaf in self.leaves if isinstance(leaf, Leaf)]

    def build(self, batch_size: int) -> Any:
        """The batch at ``batch_size``, as empty tensors (fake ones under a FakeTensorMode)."""
        out = []
        for leaf in self.leaves:
            if isinstance(leaf, Leaf):
                shape = tuple(n * batch_size if g else n for n, g in zip(leaf.shape, leaf.grows, strict=True))
                out.append(torch.empty(shape, dtype=leaf.dtype))
            else:
                out.append(leaf)
        return tree_unflatten(out, self.spec)


# --- the model, without its bytes ----------------------------------------------------------------------------------
def meta_model(task: Task, seed: int) -> tuple[nn.Module, str]:
    """The task's model on the meta device, and a note when its factory could not build there (it is then built for
    real and its tensors allocated on this machine)."""
    torch.manual_seed(seed)
    try:
        # a factory that loads pretrained weights copies them into meta parameters: a no-op, which torch warns of
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            return task.make_model(), ""
    except Exception as exc:
        note = f"the model's factory failed on the meta device ({describe_exception(exc)}); it was built for real here"
    torch.manual_seed(seed)
    try:
        return task.make_model(), note
    except Exception as exc:
        raise TaskError(f"building the model raised {describe_exception(exc)}") from exc


def materialize(model: nn.Module, mode: Any, device: torch.device) -> None:
    """Give every parameter, buffer and tensor attribute of ``model`` a fake twin on ``device`` (in place): shared
    tensors stay shared, a tensor subclass (torchao's quantized weights) gets fake inner tensors."""
    memo: dict[int, torch.Tensor] = {}
    keep: list[Any] = []  # the originals, alive until the end, so that no id is reused for another tensor

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        keep.append(t)
        if is_traceable_wrapper_subclass(t):
            names, ctx = t.__tensor_flatten__()
            inner = {n: fake(getattr(t, n)) for n in names}
            out = type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
        elif t.device.type == "meta":
            out = mode.fake_tensor_converter.from_meta_and_device(mode, t, device)
        else:
            out = mode.from_tensor(t)
        memo[id(t)] = out
        return out

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                keep.append(p)
                inner = p if is_traceable_wrapper_subclass(p) else p.detach()
                memo[id(p)] = nn.Parameter(fake(inner), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)
        for name, value in list(vars(module).items()):  # tensors kept as plain attributes (a mask, a table)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(module, name, fake(value))


@contextmanager
def faked() -> Iterator[Any]:
    """A FakeTensorMode (enter it under ``eager()``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _warm_constants()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def eager() -> Any:
    """torch.compile's functions run eagerly: inductor's kernels cannot run on fake tensors, and torch.compile
    cannot trace under a dispatch mode (the ledger); a compiled policy is counted as its eager ops."""
    return torch.compiler.set_stance("force_eager")


def _warm_constants() -> None:
    """torchao's low-bit optimizers build their quantization tables (small real constants, cached) the first time a
    state is made; made under fake tensors they would have no values to read."""
    try:
        from torchao.optim import subclass_4bit, subclass_8bit
    except Exception:  # no torchao: none of its optimizers can be asked for
        return
    for module in (subclass_8bit, subclass_4bit):
        for name in dir(module):
            if name.startswith("get_qmap"):
                getattr(module, name)()


# --- what a trace found ---------------------------------------------------------------------------------------------
@dataclass
class Traced:
    """A traced step: its peak (with the breakdown at that moment, the phase and the module), the most each category
    held at any time, the parameters' exact bytes, and what a step at another batch size can reuse: each phase's own
    peak and the state (optimizer state, master copy) the update made."""

    peak: Peak
    most: dict[str, int]
    parameter_bytes: int
    phases: dict[str, Peak] = field(default_factory=dict)
    state: dict[str, int] = field(default_factory=dict)
    gradients: int = 0  # what the backward left in the parameters' gradients


def _state(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


class Run:
    """One policy's step on one model, counted by a ledger (``fake``: under FakeTensorMode)."""

    def __init__(self, task: Task, plan: Plan, model: nn.Module, target: Target, *, fake: bool = True,
                 wrap: Callable[[nn.Module], nn.Module] | None = None, device: str = "cpu",
                 converted: bool = False) -> None:
        """Converts ``model`` (on the meta device for a fake run, else real) as the plan says, unless ``converted``
        (a copy of one converted before): a conversion that cannot be made here raises from this constructor."""
        self.task, self.plan, self.target, self.fake, self.wrap = task, plan, target, fake, wrap
        self.device = torch.device("cpu" if fake else device)
        self.precision = Precision(plan, self.device, traced=fake)
        model = model if fake else model.to(self.device)
        self.model = model if converted else self.precision.convert_module(model)

    @contextmanager
    def _counting(self) -> Iterator[Ledger]:
        with ExitStack() as stack:
            stack.enter_context(eager())
            mode = stack.enter_context(faked()) if self.fake else None
            if mode is not None:
                materialize(self.model, mode, torch.device("cpu"))
            if self.wrap is not None:
                self.model = self.wrap(self.model)
            ledger = stack.enter_context(Ledger(round_to=self.target.round_to))
            ledger.claim(self.model.parameters(), "parameters")
            ledger.claim(self.model.buffers(), "buffers")
            stack.enter_context(self.precision.session())
            yield ledger

    def _on_device(self, data: Any) -> Any:
        """The batch where the step runs, in tensors of its own: a task's batch may be a view into its data set
        (on a GPU the copy to the device makes it one; on the CPU here a copy does)."""
        if self.fake:
            return data
        return map_tensors(lambda t: t.to(self.device, copy=True), data)

    def _optimizer(self) -> torch.optim.Optimizer:
        """The task's optimizer as the policy converts it; on CUDA, torch's optimizers step every parameter at once
        (their default there: ``foreach``), unless the task asked otherwise."""
        optimizer = self.precision.convert_optimizer(self.task.make_optimizer(self.model.parameters()), self.model)
        if self.target.foreach:
            for group in optimizer.param_groups:
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
        return optimizer

    def train(self, batch: BatchShape | Callable[[int], Any], batch_size: int, steps: int = 1,
              update: bool = True) -> Traced:
        """``steps`` training steps through the policy's hooks. From one step, every later one follows (``later``):
        they run the same forward and backward with the optimizer's state alive throughout, and the same update.
        Without ``update``, the forward and backward alone (their phases, to be joined to an update traced apart)."""
        fetched = _fetched(batch, steps)
        with self._counting() as ledger:
            params = ledger.current["parameters"]
            self.model.train()
            optimizer = self._optimizer() if update else None

            def accumulated(p: torch.Tensor) -> None:  # a gradient is one as soon as autograd accumulates it
                ledger.claim([p.grad], "gradients")

            hooks = [p.register_post_accumulate_grad_hook(accumulated)
                     for p in self.model.parameters() if p.requires_grad and not hasattr(p, "to_local")]
            try:
                with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
                    for step in range(steps):
                        with ledger.phase_of("batch"):
                            data = batch.build(batch_size) if fetched is None else fetched[step]
                            inputs, target = self._on_device(_split(self.task, data))
                        if optimizer is not None:
                            loss = train_step(self.task, self.model, self.precision, optimizer, inputs, target,
                                              mark=ledger.phase_of)
                        else:  # the forward and backward of train_step, phase by phase
                            with ledger.phase_of("forward"):
                                loss = forward_loss(self.task, self.model, self.precision, inputs, target)
                            with ledger.phase_of("backward"):
                                self.precision.backward(loss)
                        del loss, inputs, target, data
                        ledger.claim((p.grad for p in self.model.parameters() if p.grad is not None), "gradients",
                                     only_from=("temporaries",))
                        if optimizer is not None:
                            ledger.claim(_state(optimizer), "optimizer_state")
                            ledger.claim(self.precision.master_tensors(optimizer), "master_weights")
            finally:
                for hook in hooks:
                    hook.remove()
            state = {k: ledger.current[k] for k in ("optimizer_state", "master_weights")}
            gradients = ledger.current["gradients"]
            peak = later(ledger.phases, state, gradients) if steps == 1 and update else ledger.peak
            return Traced(peak, dict(ledger.most), params, dict(ledger.phases), state, gradients)

    def state(self) -> Traced:
        """The update alone: the weights, a gradient for each trainable one, and one optimizer step (its phase joins
        a forward and backward traced apart; alone, it is the peak of a step whose forward cannot be traced, less
        the activations)."""
        with self._counting() as ledger:
            params = ledger.current["parameters"]
            self.model.train()
            optimizer = self._optimizer()
            with ledger.phase_of("backward", default="gradients"):
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            gradients = ledger.current["gradients"]
            with ledger.phase_of("optimizer"):
                self.precision.optimizer_step(optimizer)
            ledger.claim(_state(optimizer), "optimizer_state")
            ledger.claim(self.precision.master_tensors(optimizer), "master_weights")
            state = {k: ledger.current[k] for k in ("optimizer_state", "master_weights")}
            return Traced(later(ledger.phases, state, gradients), dict(ledger.most), params, dict(ledger.phases),
                          state, gradients)

    def weights(self) -> Traced:
        """The converted weights and buffers alone: an inference pass that cannot be traced, less what it computes."""
        with self._counting() as ledger:
            return Traced(ledger.peak, dict(ledger.most), ledger.current["parameters"], dict(ledger.phases))

    def infer(self, batch: BatchShape | Callable[[int], Any], batch_size: int) -> Traced:
        """One forward pass without gradients (the model as the policy serves it)."""
        fetched = _fetched(batch, 1)
        with self._counting() as ledger:
            params = ledger.current["parameters"]
            self.model.eval()
            with ledger.phase_of("batch"):
                inputs = self._on_device(batch.build(batch_size) if fetched is None else fetched[0])
            with torch.no_grad(), ledger.phase_of("forward"):
                out = forward(self.model, self.precision, inputs)
            del out, inputs
            return Traced(ledger.peak, dict(ledger.most), params, dict(ledger.phases))


def joined(passes: Traced, update: Traced) -> Traced:
    """A training step from its forward and backward (``passes``, traced at some batch size) and its update
    (``update``, traced apart: the weights, their gradients and the optimizer step, which no batch size changes)."""
    phases = {**passes.phases, **({"optimizer": update.phases["optimizer"]} if "optimizer" in update.phases else {})}
    most = {k: max(v, update.most.get(k, 0)) for k, v in passes.most.items()}
    return Traced(later(phases, update.state, passes.gradients), most, passes.parameter_bytes, phases,
                  dict(update.state), passes.gradients)


def _fetched(batch: BatchShape | Callable[[int], Any], steps: int) -> list[Any] | None:
    """A real run's batches, fetched before the count starts: a batch sliced from the task's data set is a view of
    it, whose storage (the whole set) the task holds anyway; the step's own batch is the copy made of it."""
    return None if isinstance(batch, BatchShape) else [batch(step) for step in range(steps)]


def later(phases: dict[str, Peak], state: dict[str, int], gradients: int) -> Peak:
    """The peak of every step after the first, from the first one's phases: the batch, forward and backward run as
    they did, now beside the optimizer's state and the master copy (``state``, which the first update made), and the
    batch is fetched while the last step's ``gradients`` are still held (the loop sets them to None as the forward
    starts); the update itself is the same (at its peak the first one's new state was there already: what the
    ledger still called temporaries then is that state)."""
    best = Peak()
    made = sum(state.values())
    for name, peak in phases.items():
        breakdown = dict(peak.breakdown)
        if name == "batch":
            breakdown["gradients"] += gradients
            made_here = made + gradients
        else:
            made_here = made
        if name == "optimizer":
            moved = min(made, breakdown["temporaries"])
            breakdown["temporaries"] -= moved
            for key, held in state.items():
                share = min(held, moved)
                breakdown[key] += share
                moved -= share
            total = peak.total
        else:
            for key, held in state.items():
                breakdown[key] += held
            total = peak.total + made_here
        if total > best.total:
            best = Peak(total, breakdown, name, peak.module)
    return best


def _split(task: Task, data: Any) -> tuple[Any, Any]:
    """(inputs, target) from what ``train_batch`` returns, as ``Task.batch`` splits it."""
    if task.compute_loss is not None:
        return data, None
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise TaskError(f"task {task.name!r}: train_batch must return (inputs, target) for loss_fn")
    return data[0], data[1]


def fresh(model: nn.Module) -> nn.Module:
    """A copy of a meta-device model to convert and trace (a deep copy of meta tensors costs nothing)."""
    return copy.deepcopy(model)


def train_batch_shape(task: Task) -> BatchShape:
    return BatchShape.of(lambda b: task.train_batch(0, b), f"task {task.name!r}: train_batch")


def infer_batch_shape(task: Task) -> BatchShape:
    return BatchShape.of(task.inference_inputs, f"task {task.name!r}: its inference batch")


__all__ = ["CATEGORIES", "BatchShape", "Run", "Target", "Traced", "eager", "faked", "fresh", "infer_batch_shape",
           "joined", "materialize", "meta_model", "train_batch_shape"]
