"""Watch a training loop for the first NaN/Inf at almost no cost, then find where it came from.

Every step: the loss and the parameters (after the optimizer has touched them) are checked for
non-finite values with one fused reduction per dtype. Every few steps, a checkpoint copies the
parameters, buffers, optimizer state, GradScaler state and RNG state into buffers reused from the last
checkpoint. On detection the failing step is replayed from the checkpoint, deterministically, with every
op of the forward pass, backward pass and optimizer step traced (see ``nonfinite``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dtypelab.core.results import Finding
from dtypelab.core.scaler import COLLAPSE_BELOW, ScalerLog
from dtypelab.core.source import Sites
from dtypelab.tracing.diagnose import path_hint
from dtypelab.tracing.nonfinite import OpTracer, storage_key
from dtypelab.tracing.snapshot import Snapshot, all_finite, checkpoint_interval

GROWTH = 100.0  # weights grown by this factor since the first checkpoint: the optimizer, not one op, is at fault
MAX_WEIGHT_HISTORY = 1000
class NonFiniteError(RuntimeError):
    """Raised by ``Guard.step`` at the first non-finite value; ``finding`` says where it came from."""

    def __init__(self, finding: Finding) -> None:
        o = finding.origin
        where = f" in {o.op} ({o.phase}{', ' + o.module if o.module else ''}): {o.diagnosis}" if o else ""
        super().__init__(f"step {finding.step}: {finding.trigger}{where}")
        self.finding = finding


@torch.no_grad()
def _loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    return None


class Guard:
    """Run training steps through ``step(fn, *args)``; raises ``NonFiniteError`` at the first NaN/Inf.

    ``fn(*args)`` must be one whole training step (zero_grad, forward, backward, optimizer step) that
    depends only on its arguments and the model/optimizer state, so that it can be replayed. It may
    return the loss (a tensor, or a tuple/dict whose first item / "loss" is one) to have it checked."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
                 checkpoint_every: int | None = None, stop_on_skip: bool = False, sites: Sites | None = None,
                 check_weights: bool = True) -> None:
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError("checkpoint_every must be at least 1 (None chooses it from the measured cost)")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.fixed_every = checkpoint_every
        self.every = checkpoint_every or 1
        self.stop_on_skip = stop_on_skip
        # False: the weights are not checked every step. Safe under a GradScaler, which skips every step whose
        # gradients are not finite; a weight that still goes non-finite shows in the next step's loss.
        self.check_weights = check_weights
        self.sites = sites
        self.named = list(model.named_parameters())
        self.params = [p for _, p in self.named]
        self.log = ScalerLog(self.named) if scaler is not None else None
        self.snapshot = Snapshot(model, optimizer, scaler)
        self.steps = 0
        self.checkpoint_step = 0
        self.checkpoint_s = 0.0
        self._pending: list[tuple[Callable[..., Any], tuple, dict]] = []
        self._step_s: list[float] = []
        self.losses: list[float] = []
        self.weight_max: list[tuple[int, float]] = []

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pending.clear()  # drop references to batches kept for replay

    def _checkpoint(self) -> None:
        start = time.perf_counter()
        self.snapshot.take()
        self._note_weights()
        self.checkpoint_s = time.perf_counter() - start
        self.checkpoint_step, self._pending = self.steps, []
        if self.fixed_every is None:
            self.every = checkpoint_interval(self.checkpoint_s, self._step_s) or self.every

    @torch.no_grad()
    def _note_weights(self) -> None:
        """max |w| now, one fused reduction: cheap beside the checkpoint's copy of every weight."""
        if not self.params or len(self.weight_max) >= MAX_WEIGHT_HISTORY:
            return
        norms = torch._foreach_norm([p.detach() for p in self.params], math.inf)
        value = float(torch.stack([n.float() for n in norms]).max())
        if not self.weight_max or self.weight_max[-1][0] != self.steps:
            self.weight_max.append((self.steps, value))

    def _note_weights_at(self, step: int) -> None:
        steps, self.steps = self.steps, step
        try:
            self._note_weights()
        finally:
            self.steps = steps

    def _growth_hint(self) -> str:
        finite = [(s, w) for s, w in self.weight_max if math.isfinite(w)]
        if len(finite) < 2 or finite[0][1] <= 0 or finite[-1][1] < GROWTH * finite[0][1]:
            return ""
        (s0, w0), (s1, w1) = finite[0], finite[-1]
        lrs = [g["lr"] for g in self.optimizer.param_groups if "lr" in g] if self.optimizer is not None else []
        lr = f" (lr={float(lrs[0]):g})" if lrs else ""
        return (f"; root cause: the weights grew {w1 / w0:.3g}x in {s1 - s0} step{'s' if s1 - s0 != 1 else ''} "
                f"(max |w| {w0:.3g} at step {s0} → {w1:.3g} at step {s1}): the optimizer is diverging, so lower the "
                f"learning rate{lr} or clip gradients; this op only overflowed first")

    def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.steps == 0 or self.steps - self.checkpoint_step >= self.every:
            self._checkpoint()
        self._pending.append((fn, args, kwargs))
        scale = self.scaler.get_scale() if self.scaler is not None else None
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        loss = _loss_of(out)
        trigger = ""
        if loss is not None:
            value = float(loss.detach().float())
            self.losses.append(value)
            if not math.isfinite(value):
                trigger = f"loss is {value}"
        if not trigger and self.check_weights and not all_finite(self.params):
            bad = [n for n, p in self.named if not bool(torch.isfinite(p).all())]
            trigger = f"parameter {bad[0]} non-finite after the optimizer step" + (
                f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        if self.scaler is not None:
            after = self.scaler.get_scale()
            skipped = self.log.record(self.steps, scale, after)
            if not trigger and skipped and (self.stop_on_skip or after < COLLAPSE_BELOW):
                trigger = (f"GradScaler skipped the step at scale {scale:g}" if after >= COLLAPSE_BELOW else
                           f"GradScaler's scale collapsed to {after:g}")
        self._step_s.append(time.perf_counter() - start)
        self.steps += 1
        if trigger:
            raise NonFiniteError(self.replay(trigger))
        return out

    def checkpoint(self) -> None:
        """Take a checkpoint now (e.g. after the model's configuration changed: a replay must run as it does now)."""
        self._checkpoint()

    def rollback(self) -> int:
        """Back to the last checkpoint (model, optimizer, scaler, RNG), the steps since it forgotten: the step to
        run next. For a caller that changes something (a layer's precision) and trains on from there."""
        self.snapshot.restore()
        self.steps, self._pending = self.checkpoint_step, []
        del self.losses[self.checkpoint_step:]
        return self.steps

    def _names(self) -> dict[int, str]:
        names = {storage_key(p): f"{n} (parameter)" for n, p in self.named}
        if self.optimizer is not None:
            index = {id(p): n for n, p in self.named}
            for p, st in self.optimizer.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        names[storage_key(v)] = f"optimizer {k} of {index.get(id(p), '?')}"
        return names

    def replay(self, trigger: str) -> Finding:
        """Restore the checkpoint, re-run the steps since it untraced and the failing one traced."""
        fail_step = self.steps - 1
        self.snapshot.restore()
        *before, (fn, args, kwargs) = self._pending
        for f, a, k in before:
            f(*a, **k)
        self._note_weights_at(fail_step)
        names = self._names()
        for t in _tensors((args, kwargs)):
            names.setdefault(storage_key(t), "the input batch")
        start = time.perf_counter()
        with OpTracer(self.model, self.optimizer, names, step=fail_step, sites=self.sites) as tracer:
            out = fn(*args, **kwargs)
        trace_s = time.perf_counter() - start
        return finding_of(tracer, self.named, _loss_of(out), trigger, fail_step, trace_s,
                          weight_max=tuple(self.weight_max), growth_hint=self._growth_hint(),
                          checkpoint_step=self.checkpoint_step, replayed_steps=len(before))


def trace_forward(model: nn.Module, calls: list[tuple[tuple, dict]], trigger: str, step: int) -> Finding:
    """The origin of a non-finite step whose whole step cannot be replayed (a script's loss and backward are its own
    code): the model's forward on the step's inputs (``calls``: each forward's args and kwargs), replayed without
    gradients under the op tracer until one output is non-finite. The caller restores the state (weights, RNG) the
    step started from. A value that went non-finite only in the loss or the backward is not found here."""
    named = list(model.named_parameters())
    names = {storage_key(p): f"{n} (parameter)" for n, p in named}
    for t in _tensors(calls):
        names.setdefault(storage_key(t), "the input batch")
    start = time.perf_counter()
    with torch.no_grad(), OpTracer(model, None, names, step=step) as tracer:
        out = None
        for args, kwargs in calls:
            out = model(*args, **kwargs)
            if not all_finite([t.detach() for t in _tensors(out) if t.is_floating_point()]):
                break
    return finding_of(tracer, [], _loss_of(out), trigger, step, time.perf_counter() - start)


def finding_of(tracer: OpTracer, named: list[tuple[str, nn.Parameter]], loss: torch.Tensor | None, trigger: str,
               step: int, trace_s: float, *, weight_max: tuple[tuple[int, float], ...] = (), growth_hint: str = "",
               checkpoint_step: int = 0, replayed_steps: int = 0) -> Finding:
    """The finding of a traced step that went non-finite: the first op whose non-finite output reached the loss,
    a gradient or a parameter (else the first non-finite op at all), its path and diagnosis."""
    targets = []
    if loss is not None:
        targets.append(("loss", loss.detach()))
    targets += [(f"{n} (gradient)", p.grad) for n, p in named if p.grad is not None]
    targets += [(f"{n} (parameter)", p.detach()) for n, p in named]
    reached: dict[int, list[str]] = {}
    for label, t in targets:
        idx = tracer.origin_of(t)
        if idx is not None and tracer.events[idx].kind != "mask":
            reached.setdefault(idx, []).append(label)
    origins = [e for e in tracer.events if e.kind != "mask"]
    first = min(reached) if reached else (origins[0].index if origins else None)
    origin = tracer.events[first] if first is not None else None
    path = tuple(tracer.paths.get(first, ())) if first is not None else ()
    if origin is not None and origin.kind == "origin":
        hint = "" if "root cause" in origin.diagnosis else (path_hint(origin.op, path) or growth_hint)
        origin = replace(origin, diagnosis=origin.diagnosis + hint)
    return Finding(
        step=step, trigger=trigger, reproduced=bool(reached), origin=origin,
        path=path, weight_max=weight_max,
        reached=tuple(reached.get(first, ())) if first is not None else (),
        others=tuple(e for e in origins if e.index != first)[:20],
        masks=sum(e.kind == "mask" for e in tracer.events), checkpoint_step=checkpoint_step,
        replayed_steps=replayed_steps, trace_s=trace_s, ops_traced=tracer.ops)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
          checkpoint_every: int | None = None, stop_on_skip: bool = False) -> Guard:
    """``with dtypelab.watch(model, opt) as guard: ... guard.step(train_step, x, y)``: see ``Guard``."""
    return Guard(model, optimizer, scaler=scaler, checkpoint_every=checkpoint_every, stop_on_skip=stop_on_skip)
