"""Op-level tracing of one training step: every aten op of the forward pass, the backward pass and the
optimizer is checked for NaN/Inf, and each non-finite value is followed back to the op that created it.

Lineage is kept per storage: an op whose output is non-finite inherits the origin of its non-finite
inputs (it only propagated), or becomes an origin itself when it created a kind of non-finite value its
inputs did not have. Infinities written on purpose (a literal ±inf argument: masked_fill, where, full,
pad) are recorded as masks, not errors; a NaN made from masks (a row that is entirely −inf) is an error.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from dtypelab.core.results import OpEvent
from dtypelab.core.source import Sites, user_source
from dtypelab.tracing.diagnose import explain, root_hint, summarize_tensor

# Ops that write no values of their own (outputs alias an input or are uninitialised memory).
_NO_VALUES = {"detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "resize_", "set_", "_local_scalar_dense"}
_MAX_PATH = 8  # ops shown between the origin and what it reached


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None


def _floats(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
            and t.device.type != "meta"]


def _flags(t: torch.Tensor) -> tuple[bool, bool]:
    """(has NaN, has ±inf)."""
    if bool(torch.isfinite(t).all()):
        return False, False
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an in-place or out= op writes to, from its schema."""
    if not func._schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += _floats(value)
    return out


def _element(value: Any, i: int) -> Any:
    """Element i of a foreach op's tensor-list argument; other arguments unchanged."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[i] if i < len(value) else value[0]
    return value


def _has_inf_literal(args: tuple, kwargs: dict) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(v, float) and v in (float("inf"), float("-inf")) for v in leaves)


# tensors, each with whether it holds a NaN and whether it holds an infinity
Flagged = tuple[list[torch.Tensor], list[tuple[bool, bool]]]


@dataclass
class _ForwardInfo:
    op: str
    module: str
    source: str
    code: str
    via: str = ""
    hint: str = ""  # a root cause known from how the op's input was made (log of a softmax), for its backward too


@dataclass(frozen=True)
class _Made:
    """How a forward tensor was made, enough to recognise the unstable idioms the lint rules know."""

    op: str  # aten base name, e.g. "_softmax"
    one: bool  # a scalar argument equal to 1 (x + 1, exp(x) - 1)
    inputs: tuple[str, ...]  # the ops that made its tensor inputs


def _has_one(args: tuple, kwargs: dict) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1 for v in leaves)


class OpTracer(TorchDispatchMode):
    """Trace every op while active. ``names`` maps storages the caller knows (parameters, the input batch)
    to readable names, so a value that was already non-finite is reported as such."""

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 names: dict[int, str] | None = None, step: int | None = None, sites: Sites | None = None) -> None:
        super().__init__()
        self.model, self.optimizer, self.step = model, optimizer, step
        self.sites = sites or Sites()
        self._marks = {self.sites.loss_code: "loss"} if self.sites.loss_code is not None else {}
        self._types: dict[str, str] = {}
        self._made: dict[int, _Made] = {}  # storage key -> how the forward pass made it
        self.names = dict(names or {})
        self.events: list[OpEvent] = []
        self.paths: dict[int, list[str]] = {}  # event index -> ops it propagated through
        self.lineage: dict[int, int] = {}  # storage key -> event index
        self._modules: list[str] = []
        self._in_optimizer = False
        self._pending: list[tuple[weakref.ref, _ForwardInfo]] = []
        self._nodes: dict[int, _ForwardInfo] = {}  # autograd node sequence number -> forward op
        self._handles: list[Any] = []
        self._before: dict[int, torch.Tensor] = {}
        self.ops = 0

    # --- module and optimizer context ----------------------------------------------------------
    def __enter__(self) -> OpTracer:
        if self.model is not None:
            for path, module in self.model.named_modules():
                name = path or "(model)"
                self._types[name] = type(module).__name__
                self._handles.append(module.register_forward_pre_hook(
                    lambda m, a, name=name: self._modules.append(name)))
                self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(lambda *a: self._set_opt(True)))
            self._handles.append(self.optimizer.register_step_post_hook(lambda *a: self._set_opt(False)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._modules:  # returns None: a forward hook's return value would replace the output
            self._modules.pop()

    def _set_opt(self, on: bool) -> None:
        self._in_optimizer = on

    # --- the per-op check ----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_VALUES:
            return func(*args, **kwargs)
        self.ops += 1
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else ("optimizer" if self._in_optimizer else "forward")
        if self._pending:
            self._map_nodes()
        inputs = _floats((args, kwargs))
        flags = [_flags(t) for t in inputs]  # before the call: an in-place op overwrites its input
        # What an in-place op is about to overwrite, as it was: for the report and the diagnosis only
        # (lineage follows the real tensors). Replay-only cost.
        written = _written(func, args, kwargs)
        self._before = {id(t): t.detach().clone() for t in written}
        out = func(*args, **kwargs)
        outputs = _floats(out)
        seen = {id(t) for t in outputs}
        outputs += [t for t in written if id(t) not in seen]
        info = None
        if phase == "forward":
            made = [self._made[k] for k in map(storage_key, inputs) if k in self._made]
            info = self._forward_info(f"aten.{name}", root_hint(name, made))
            self._pending += [(weakref.ref(t), info) for t in outputs]
            record = _Made(name, _has_one(args, kwargs), tuple(m.op for m in made))
            for k in map(storage_key, outputs):
                if k is not None:
                    self._made[k] = record
        out_flags = [_flags(t) for t in outputs]
        if not any(n or i for n, i in out_flags):
            for t in outputs:  # finite values overwrote whatever this storage held
                if not t._is_view() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
                    self.lineage.pop(storage_key(t), None)
            return out
        if name.startswith("_foreach_"):  # one op over a list of tensors: report the first bad element
            i = next(k for k, (n, f) in enumerate(out_flags) if n or f)
            by_id = {id(t): f for t, f in zip(inputs, flags, strict=True)}
            args, kwargs = tuple(_element(a, i) for a in args), {k: _element(v, i) for k, v in kwargs.items()}
            narrowed = _floats((args, kwargs))
            event = self._attribute(func, name, phase, node, info, args, kwargs,
                                    (narrowed, [by_id.get(id(t), _flags(t)) for t in narrowed]),
                                    ([outputs[i]], [out_flags[i]]))
        else:
            event = self._attribute(func, name, phase, node, info, args, kwargs, (inputs, flags),
                                    (outputs, out_flags))
        for t, (n, i) in zip(outputs, out_flags, strict=True):
            if (n or i) and storage_key(t) is not None:
                self.lineage[storage_key(t)] = event
        return out

    def _forward_info(self, op: str, hint: str) -> _ForwardInfo:
        module = self._modules[-1] if self._modules else ""
        source, code, how = user_source(self._marks)
        inside = f"built-in module {module} ({self._types.get(module, '?')})" if module else ""
        via = ""
        if how == "module":
            via = f"the nearest line of your code: it calls into {inside}"
        elif not source and module and self.sites.model:
            (source, code), via = self.sites.model, (f"no line of your code runs this op: it runs inside {inside} "
                                                     "of the model built here")
        elif not source and how == "loss" and self.sites.loss:
            (source, code), via = self.sites.loss, (f"no line of your code runs this op: the task's loss_fn "
                                                    f"({self.sites.loss_name}) computes it, set here")
        return _ForwardInfo(op, module, source, code, via, hint)

    def _map_nodes(self) -> None:
        """Remember which forward op made each autograd node, so backward ops can name their module."""
        # By the next op, autograd has attached grad_fn to the previous op's outputs (if they need grads).
        for ref, info in self._pending:
            t = ref()
            if t is not None and t.grad_fn is not None:
                self._nodes.setdefault(t.grad_fn._sequence_nr(), info)
        self._pending = []

    def _attribute(self, func: Any, name: str, phase: str, node: Any, info: _ForwardInfo | None,
                   args: tuple, kwargs: dict, ins: Flagged, outs: Flagged) -> int:
        """The event index the op's non-finite output descends from, creating an event when it is new (``ins``,
        ``outs``: the op's floating tensors and whether each holds a NaN, an infinity)."""
        (inputs, flags), (outputs, out_flags) = ins, outs
        out_nan = any(n for n, _ in out_flags)
        nan_in = [t for t, (n, _) in zip(inputs, flags, strict=True) if n]
        inf_in = [t for t, (_, i) in zip(inputs, flags, strict=True) if i]
        source = None
        if out_nan and nan_in:
            source = self._source(nan_in[0])
        elif out_nan and inf_in:  # infinities became NaN here: blame a real upstream origin if any
            real = [s for s in (self._source(t) for t in inf_in) if self.events[s].kind != "mask"]
            source = real[0] if real else None
        elif not out_nan and (inf_in or nan_in):
            source = self._source((inf_in or nan_in)[0])
        if source is not None:
            path = self.paths.setdefault(source, [])
            if len(path) < _MAX_PATH:
                fwd = info if info else (self._nodes.get(node._sequence_nr()) if node is not None else None)
                where = fwd.module if fwd else ""
                path.append(f"aten.{name} ({phase}{', ' + where if where else ''})")
            return source
        kind = "mask" if not out_nan and _has_inf_literal(args, kwargs) else "origin"
        masks = [self.events[self._source(t)] for t in inf_in]
        pre = self._before
        shown = [pre.get(id(t), t) for t in inputs]
        args_pre, kwargs_pre = tree_map(lambda v: pre.get(id(v), v) if isinstance(v, torch.Tensor) else v,
                                        (args, kwargs))
        diagnosis = explain(name, func, args_pre, kwargs_pre, shown, flags, outputs, out_flags, masks)
        if phase == "optimizer":
            diagnosis += self._eps_hint(outputs)
        if phase == "backward":
            fwd = self._nodes.get(node._sequence_nr())
            diagnosis += fwd.hint if fwd and fwd.hint else ""
            module, source_line, code, via = (fwd.module, fwd.source, fwd.code, fwd.via) if fwd else ("", "", "", "")
            backward_of = fwd.op if fwd else node.name()
        else:
            module, source_line, code, via = (
                (info.module, info.source, info.code, info.via) if info else ("", "", "", ""))
            backward_of = ""
            diagnosis += info.hint if info and info.hint else ""
        param = next((self.names[k] for k in map(storage_key, outputs) if k in self.names), "")
        return self._add(OpEvent(
            index=len(self.events), step=self.step, phase=phase, op=f"aten.{name}", kind=kind, module=module,
            source=source_line, code=code, backward_of=backward_of,
            inputs=tuple(summarize_tensor(t) for t in shown[:4]),
            outputs=tuple(summarize_tensor(t) for t in outputs[:2]), diagnosis=diagnosis, tensor=param, via=via))

    def _add(self, event: OpEvent) -> int:
        self.events.append(event)
        return event.index

    def _source(self, t: torch.Tensor) -> int:
        """The event a non-finite input descends from; one that came from outside the step gets an event."""
        key = storage_key(t)
        if key in self.lineage:
            return self.lineage[key]
        nan, _ = _flags(t)
        known = self.names.get(key, "")
        kind = "mask" if not known and not nan else "external"  # e.g. torch.tensor(float('-inf'))
        what = known or "a tensor created before this step"
        idx = self._add(OpEvent(
            index=len(self.events), step=self.step, phase="input", op="", kind=kind, module="", source="",
            code="", backward_of="", inputs=(), outputs=(summarize_tensor(t),), tensor=known,
            diagnosis=f"input already non-finite: {what}"))
        if key is not None:
            self.lineage[key] = idx
        return idx

    def _eps_hint(self, outputs: list[torch.Tensor]) -> str:
        if self.optimizer is None or not outputs:
            return ""
        dtype = outputs[0].dtype
        eps = [g["eps"] for g in self.optimizer.param_groups if isinstance(g.get("eps"), float) and g["eps"] > 0]
        if eps and float(torch.tensor(eps[0], dtype=dtype)) == 0.0:
            return (f"; the optimizer's eps={eps[0]:g} rounds to 0 in {str(dtype).removeprefix('torch.')}, so "
                    "its denominator can be 0: keep weights and optimizer state in float32 (autocast) or raise eps")
        return ""

    # --- after the step ------------------------------------------------------------------------
    def origin_of(self, t: torch.Tensor) -> int | None:
        """The event index a non-finite tensor descends from, or None when it is finite or unknown."""
        if not t.is_floating_point() or not any(_flags(t)):
            return None
        return self._source(t)
