"""One training step or one inference forward pass of a task under a policy, counted by the ledger: on fake tensors
for the forecast, on real ones for ``--check``; and from one step's phases, the peak of every later step.

The model is built on the meta device (nothing the size of the model is allocated), converted there by the policy's
own kinds (``Precision.convert_module``: casts, regions, quantized layouts, float8 layers), then each parameter and
buffer gets a fake twin on the CPU (a quantized weight's inner tensors each get theirs). The step is the loop's own
``train_step`` through the policy's hooks, under ``FakeTensorMode`` and with ``torch.compile`` run eagerly (inductor
cannot run on fake tensors; torchao's 8-bit optimizer compiles its step). The batch is built from its shapes alone,
at any batch size, from two small real batches (``BatchShape``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtypelab.core.footprint import state_tensors
from dtypelab.core.loop import forward, forward_loss, train_step
from dtypelab.core.machine.speed import Op
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.policies.checkpointing import repeated_blocks
from dtypelab.core.policies.loss import logit_width
from dtypelab.core.results import PeakForecast
from dtypelab.core.task import Task, map_tensors
from dtypelab.forecasting.batch import BatchShape, fetched, split
from dtypelab.forecasting.fake import eager, faked, materialize
from dtypelab.forecasting.ledger import CUDA_BLOCK, Ledger, Peak


@dataclass(frozen=True)
class Target:
    """The device whose behaviour the trace follows: CUDA's caching allocator rounds each block up to 512 bytes, and
    torch's optimizers step every parameter at once there (``foreach``, their default on CUDA: its intermediates
    hold one more copy of the state being updated); on the CPU they step one parameter at a time."""

    kind: str = "cuda"
    timed: bool = False  # record each op's cost for the time model (a device with rates was named)

    @property
    def round_to(self) -> int:
        return CUDA_BLOCK if self.kind == "cuda" else 1

    @property
    def foreach(self) -> bool:
        return self.kind == "cuda"


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
    ops: tuple[Op, ...] = ()  # one step's kernels as the time model takes them (core.machine.speed)
    held: dict[str, int] = field(default_factory=dict)  # what the step still holds as its update runs (the batch)
    # each pass's peak by where in a stack of blocks it fell (Ledger.moments; empty: not kept)
    moments: dict[str, Peak] = field(default_factory=dict)
    # read off the line through two shallow traces: their ops, and the depth
    shallow: tuple[tuple[Op, ...], tuple[Op, ...], int] | None = None


class Run:
    """One policy's step on one model, counted by a ledger (``fake``: under FakeTensorMode)."""

    def __init__(self, task: Task, plan: Plan, model: nn.Module, target: Target, *, fake: bool = True,
                 wrap: Callable[[nn.Module], nn.Module] | None = None, device: str = "cpu",
                 converted: bool = False, moments: bool = False, timed: bool = True) -> None:
        """Converts ``model`` (on the meta device for a fake run, else real) as the plan says, unless ``converted``
        (a copy of one converted before): a conversion that cannot be made here raises from this constructor.
        ``moments``: keep each phase's peak by where in the stack of blocks it fell (``Ledger.moments``);
        ``timed``: record the ops for the time model, where the target has one (not for a size only searched)."""
        self.task, self.plan, self.target, self.fake, self.wrap = task, plan, target, fake, wrap
        self.moments, self.timed = moments, timed and target.timed
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
            ledger = stack.enter_context(Ledger(round_to=self.target.round_to, ops=[] if self.timed else None,
                                                calls=self.target.kind == "cpu"))
            if self.moments:
                ledger.blocks = {name: i for i, name in enumerate(repeated_blocks(self.model))}
            ledger.loss_width = logit_width(self.model)  # the logits and what is as wide: the loss's share
            # the weights that do not train (a fine-tuned model's frozen base) apart from those that do
            ledger.claim((p for p in self.model.parameters() if not p.requires_grad), "frozen_weights")
            ledger.claim((p for p in self.model.parameters() if p.requires_grad), "parameters")
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
        ready = fetched(batch, steps)
        held: dict[str, int] = {}
        with self._counting() as ledger:
            params = weights_held(ledger)
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
                            data = batch.build(batch_size) if ready is None else ready[step]
                            inputs, target = self._on_device(split(self.task, data))
                        if optimizer is not None:
                            loss = train_step(self.task, self.model, self.precision, optimizer, inputs, target,
                                              mark=ledger.phase_of)
                        else:  # the forward and backward of train_step, phase by phase
                            with ledger.phase_of("forward"):
                                loss = forward_loss(self.task, self.model, self.precision, inputs, target)
                            with ledger.phase_of("backward"):
                                self.precision.backward(loss)
                            # the batch and the loss, alive while the update runs (the loop lets them go after the step)
                            held = ledger.held_by([loss, inputs, target, data])
                        del loss, inputs, target, data
                        ledger.claim((p.grad for p in self.model.parameters() if p.grad is not None), "gradients",
                                     only_from=("temporaries",))
                        if optimizer is not None:
                            ledger.claim(state_tensors(optimizer), "optimizer_state")
                            ledger.claim(self.precision.master_tensors(optimizer), "master_weights")
            finally:
                for hook in hooks:
                    hook.remove()
            state = {k: ledger.current[k] for k in ("optimizer_state", "master_weights")}
            gradients = ledger.current["gradients"]
            peak = later(ledger.phases, state, gradients) if steps == 1 and update else ledger.peak
            return Traced(peak, dict(ledger.most), params, dict(ledger.phases), state, gradients,
                          tuple(ledger.ops or ()) if steps == 1 else (), held, moments=dict(ledger.moments))

    def state(self) -> Traced:
        """The update alone: the weights, a gradient for each trainable one, and one optimizer step (its phase joins
        a forward and backward traced apart; alone, it is the peak of a step whose forward cannot be traced, less
        the activations)."""
        with self._counting() as ledger:
            params = weights_held(ledger)
            self.model.train()
            optimizer = self._optimizer()
            with ledger.phase_of("backward", default="gradients"):
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            gradients = ledger.current["gradients"]
            with ledger.phase_of("optimizer"):
                self.precision.optimizer_step(optimizer)
            ledger.claim(state_tensors(optimizer), "optimizer_state")
            ledger.claim(self.precision.master_tensors(optimizer), "master_weights")
            state = {k: ledger.current[k] for k in ("optimizer_state", "master_weights")}
            update = tuple(op for op in ledger.ops or () if op.group == "optimizer")
            return Traced(later(ledger.phases, state, gradients), dict(ledger.most), params, dict(ledger.phases),
                          state, gradients, update)

    def weights(self) -> Traced:
        """The converted weights and buffers alone: an inference pass that cannot be traced, less what it computes."""
        with self._counting() as ledger:
            return Traced(ledger.peak, dict(ledger.most), weights_held(ledger), dict(ledger.phases))

    def infer(self, batch: BatchShape | Callable[[int], Any], batch_size: int) -> Traced:
        """One forward pass without gradients (the model as the policy serves it)."""
        ready = fetched(batch, 1)
        with self._counting() as ledger:
            params = weights_held(ledger)
            self.model.eval()
            with ledger.phase_of("batch"):
                inputs = self._on_device(batch.build(batch_size) if ready is None else ready[0])
            with torch.no_grad(), ledger.phase_of("forward"):
                out = forward(self.model, self.precision, inputs)
            del out, inputs
            return Traced(ledger.peak, dict(ledger.most), params, dict(ledger.phases), ops=tuple(ledger.ops or ()))


def weights_held(ledger: Ledger) -> int:
    """The bytes of every weight, frozen or trained."""
    return ledger.current["frozen_weights"] + ledger.current["parameters"]


def joined(passes: Traced, update: Traced) -> Traced:
    """A training step from its forward and backward (``passes``, traced at some batch size) and its update
    (``update``, traced apart: the weights, their gradients and the optimizer step, which no batch size changes)."""
    optimizer = update.phases.get("optimizer")
    if optimizer is not None and passes.held:  # the update runs while the step's batch is still held
        breakdown = dict(optimizer.breakdown)
        for k, v in passes.held.items():
            breakdown[k] += v
        optimizer = Peak(optimizer.total + sum(passes.held.values()), breakdown, optimizer.phase, optimizer.module)
    phases = {**passes.phases, **({"optimizer": optimizer} if optimizer is not None else {})}
    most = {k: max(v, update.most.get(k, 0)) for k, v in passes.most.items()}
    return Traced(later(phases, update.state, passes.gradients), most, passes.parameter_bytes, phases,
                  dict(update.state), passes.gradients, passes.ops + update.ops, moments=dict(passes.moments))


def later(phases: dict[str, Peak], state: dict[str, int], gradients: int) -> Peak:
    """The peak of every step after the first, from the first one's phases (``stepped``): the highest of them."""
    best = Peak()
    for peak in stepped(phases, state, gradients).values():
        if peak.total > best.total:
            best = peak
    return best


def stepped(phases: dict[str, Peak], state: dict[str, int], gradients: int) -> dict[str, Peak]:
    """Each phase's peak in every step after the first, from the first one's phases (``after``)."""
    return {name: after(name, peak, state, gradients) for name, peak in phases.items()}


def after(phase: str, peak: Peak, state: dict[str, int], gradients: int) -> Peak:
    """A moment of the first step's ``phase`` as every later step has it: the batch, forward and backward run as
    they did, now beside the optimizer's state and the master copy (``state``, which the first update made), and the
    batch is fetched while the last step's ``gradients`` are still held (the loop sets them to None as the forward
    starts); the update itself is the same (at its peak the first one's new state was there already: what the
    ledger still called temporaries then is that state)."""
    made = sum(state.values())
    breakdown = dict(peak.breakdown)
    if phase == "batch":
        breakdown["gradients"] += gradients
        made += gradients
    if phase == "optimizer":
        moved = min(sum(state.values()), breakdown["temporaries"])
        breakdown["temporaries"] -= moved
        for key, held in state.items():
            share = min(held, moved)
            breakdown[key] += share
            moved -= share
        return Peak(peak.total, breakdown, phase, peak.module)
    for key, held in state.items():
        breakdown[key] += held
    return Peak(peak.total + made, breakdown, phase, peak.module)


def peak_forecast(traced: Traced, batch_size: int, activations: bool) -> PeakForecast:
    p = traced.peak
    return PeakForecast(batch_size=batch_size, peak_bytes=p.total,
                        breakdown={k: int(v) for k, v in p.breakdown.items()}, phase=p.phase, module=p.module,
                        activations_bytes=traced.most["activations"] if activations else None,
                        parameter_bytes=traced.parameter_bytes)


def shifted(traced: Traced, extra: int, category: str) -> Traced:
    """``traced`` with ``extra`` bytes held all along in ``category`` (weights by their layout, DDP's buckets)."""
    if not extra:
        return traced
    breakdown = dict(traced.peak.breakdown)
    breakdown[category] += extra
    most = dict(traced.most)
    most[category] += extra
    params = traced.parameter_bytes + (extra if category == "parameters" else 0)
    return Traced(Peak(traced.peak.total + extra, breakdown, traced.peak.phase, traced.peak.module), most, params,
                  ops=traced.ops)


__all__ = ["Run", "Target", "Traced", "joined", "later", "stepped"]
