"""Recording value ranges on a training loop (forward hooks on every module's outputs, their gradients, the
parameters' gradients) and judging them against each format: what ``audit`` runs on a Task's loop and the audit
diagnosis runs on a script's."""

from __future__ import annotations

import math
import re
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from dtypelab.core.results import (
    AuditConfig,
    AuditReport,
    FormatLimits,
    FormatVerdict,
    LayerAudit,
    Risk,
)
from dtypelab.numerics.catalog import get_format
from dtypelab.numerics.rangestats import RangeCounter, RangeStats

KIND_ORDER = ("activation", "grad", "param_grad")
# A fraction of values below these is noise; above, a format's verdict changes (see _verdict).
UNDERFLOW_FLAG = 1e-2  # gradient values flushed to zero: loss scaling needed
MINOR_FLAG = 1e-4  # flushed or subnormal: worth knowing, rarely harmful
HEADROOM = 2.0  # the recommended loss scale leaves this factor below float16's max


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for every tensor in a nested output: '', '[0]', "['logits']", ..."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}[{i}]")


@dataclass
class _Entry:
    module: str
    kind: str
    stats: RangeStats
    calls: int = 0


@dataclass
class Recorder:
    """Accumulates statistics per (name, kind). Identical tensors (a container returning its child's
    output, a gradient seen by two hooks) are measured once per step and credited to both."""

    counter: RangeCounter
    active: bool = False
    grad_scale: float = 1.0
    entries: dict[tuple[str, str], _Entry] = field(default_factory=dict)
    _seen: dict[tuple, tuple[weakref.ref, RangeStats | None]] = field(default_factory=dict)

    def new_step(self, active: bool, grad_scale: float = 1.0) -> None:
        self.active, self.grad_scale, self._seen = active, grad_scale, {}

    def record(self, name: str, module: str, kind: str, t: torch.Tensor) -> None:
        if not (self.active and t.is_floating_point()) or t.layout != torch.strided:
            return  # integer outputs (indices, masks) cannot overflow a float format; sparse ones are skipped
        # Same storage, same elements in the same order (a view such as Flatten's, or a container's
        # output) means the same statistics.
        key = (t.data_ptr(), t.dtype, t.numel(), t.is_contiguous() or t.stride(), t._version, kind != "activation")
        # An address alone does not identify a tensor: a tensor freed within the step hands its memory to the
        # next one of the same size. The entry keeps a weak reference to the tensor it measured; once that
        # tensor is gone the address may belong to another, so the entry is stale and measured afresh.
        seen = self._seen.get(key)
        if seen is None or seen[0]() is None:
            x = t.detach()
            if kind != "activation" and self.grad_scale != 1.0:
                x = x.float() / self.grad_scale  # report true gradients, not GradScaler's scaled ones
            # binade histograms only for gradients: the loss-scale advice needs them, and they cost most
            seen = self._seen[key] = (weakref.ref(t), self.counter(x, histogram=kind != "activation"))
        stats = seen[1]
        if stats is None:
            return
        entry = self.entries.setdefault((name, kind), _Entry(module, kind, RangeStats(self.counter.formats)))
        entry.stats.merge(stats)
        entry.calls += 1


def install_hooks(model: nn.Module, rec: Recorder, pattern: re.Pattern[str] | None) -> list[Any]:
    handles = []
    for path, module in model.named_modules():  # named_modules visits a shared module once
        name = path or "(model)"
        if pattern and not pattern.search(name):
            continue

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if not rec.active:
                return
            kind = type(mod).__name__
            for suffix, t in _walk(out):
                rec.record(name + suffix, kind, "activation", t)
                if t.requires_grad:
                    t.register_hook(lambda g, n=name + suffix, m=kind: rec.record(n, m, "grad", g))

        handles.append(module.register_forward_hook(hook))
    return handles


def _verdict(stats: RangeStats, fmt: str, kind: str) -> FormatVerdict:
    """What ``fmt`` would do to one tensor family: its risk and the measured detail."""
    f = get_format(fmt)
    over, under, sub = (stats.fraction(fmt, k) for k in ("overflow", "underflow", "subnormal"))
    if stats.nonfinite:
        return FormatVerdict(Risk.NONFINITE, f"non-finite already: {_pct(stats.nonfinite / (stats.numel or 1))}")
    if over:
        return FormatVerdict(Risk.OVERFLOW, f"overflow risk: {_pct(over)} beyond ±{f.max:g}")
    if kind != "activation" and under + sub >= UNDERFLOW_FLAG:
        return FormatVerdict(Risk.GRADIENT_UNDERFLOW, f"gradient underflow: needs loss scaling ({_pct(under)} → 0, "
                                                      f"{_pct(sub)} subnormal)")
    if under >= UNDERFLOW_FLAG:
        return FormatVerdict(Risk.UNDERFLOW, f"underflow: {_pct(under)} flush to zero")
    if sub >= UNDERFLOW_FLAG:
        return FormatVerdict(Risk.PRECISION_LOSS, f"precision loss: {_pct(sub)} subnormal")
    if under >= MINOR_FLAG:
        return FormatVerdict(Risk.MINOR_UNDERFLOW, f"minor underflow: {_pct(under)} flush to zero")
    if stats.max_abs > f.max / 4:
        return FormatVerdict(Risk.LITTLE_HEADROOM,
                             f"little headroom: max |x| {stats.max_abs:.3g} within 4x of {f.max:g}")
    return FormatVerdict(Risk.SAFE, "safe")


def format_limits(fmts: tuple[str, ...]) -> dict[str, FormatLimits]:
    """Each audited format's range, kept in the record: renderers draw it without the formats registry."""
    out: dict[str, FormatLimits] = {}
    for name in fmts:
        f = get_format(name)
        out[name] = {"max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": f.smallest_subnormal}
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"


def loss_scale_advice(entries: list[LayerAudit]) -> dict[str, Any]:
    """A float16 initial loss scale from the gradient ranges: the largest power of two that keeps the
    largest gradient HEADROOM below float16's max, with the flush-to-zero fraction before and after."""
    grads = [RangeStats.from_dict(e.stats) for e in entries if e.kind != "activation"]
    total = RangeStats(grads[0].formats) if grads else None
    for g in grads:
        total.merge(g)
    if total is None or total.max_abs == 0 or not math.isfinite(total.max_abs):
        return {}
    fp16 = get_format("float16")
    k = math.floor(math.log2(fp16.max / HEADROOM / total.max_abs))
    nonzero = total.numel - total.zeros - total.nonfinite
    # |g|·2^k flushes to zero in float16 when below half the smallest subnormal: 2^(-25-k)
    cut = math.log2(fp16.smallest_subnormal / 2) - k
    flushed = sum(c for e, c in total.binades.items() if e < cut)
    unscaled = total.counts["float16"]["underflow"] if "float16" in total.counts else None
    return {"log2_scale": k, "scale": 2.0**k, "max_grad": total.max_abs, "min_grad": total.min_nonzero,
            "flushed_unscaled": unscaled / nonzero if unscaled is not None and nonzero else None,
            "flushed_at_scale": flushed / nonzero if nonzero else 0.0,
            "gradscaler_default_overflows": 2.0**k * HEADROOM < 2.0**16}


def build_report(config: AuditConfig, rec: Recorder, losses: list[float], status: str, reason: str,
            environment: dict[str, Any], wall_s: float, updates: Any = ()) -> AuditReport:
    rows = []
    for (name, kind), e in rec.entries.items():
        verdicts = {f: _verdict(e.stats, f, kind) for f in config.formats}
        severity = max((v.severity for v in verdicts.values()), default=0)
        risk = sum(e.stats.fraction(f, k) for f in config.formats for k in ("overflow", "underflow"))
        rows.append((-severity, -risk, KIND_ORDER.index(kind), LayerAudit(
            name=name, module=e.module, kind=kind, calls=e.calls, stats=e.stats.to_dict(), severity=severity,
            verdicts=verdicts)))
    rows.sort(key=lambda r: r[:3])
    layers = tuple(r[3] for r in rows)
    config = replace(config, limits=config.limits or format_limits(config.formats))
    return AuditReport(config=config, environment=environment, layers=layers, loss_scale=loss_scale_advice(layers),
                       losses=tuple(losses), status=status, reason=reason, wall_s=wall_s, updates=tuple(updates),
                       created=time.strftime("%Y-%m-%dT%H:%M:%S"))
