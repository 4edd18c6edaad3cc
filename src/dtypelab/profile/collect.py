"""Profile a few steps of a policy with torch.profiler and summarise where the time went.

The steps run after the policy's measurement, on the same warm model, so the profiler's cost never enters
the measured step time; it is reported apart (a profiled step's wall time against the unprofiled median).
Each phase of a step is bracketed by a ``record_function`` and, on CUDA, synchronised at its ends, so the
phases' wall times add up to the step's.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import forward, to_device, train_step
from dtypelab.core.policies import Autocast, Precision
from dtypelab.core.results import OpStat, ProfileSummary, SourceOp
from dtypelab.core.source import user_source
from dtypelab.core.task import Task
from dtypelab.profile.flops import FORMULAS, op_flops

TOP_OPS = 12
LISTED_SHARE = 0.005  # an op ran in float32 under autocast: listed from this share of the step up
# ops that only dispatch (autocast sees them first with their float32 inputs, then casts and re-dispatches)
_WRAPPERS = ("aten::to", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::linear", "aten::matmul",
             "aten::cross_entropy_loss", "aten::log_softmax", "aten::nll_loss", "aten::nll_loss_nd", "aten::softmax")
_OP = re.compile(r"^(aten|quantized|torchao|mkldnn|prims|fbgemm|_c10d_functional|c10d)::")
_SCALER_OPS = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")
_DTYPES = {"float": "float32", "double": "float64", "c10::BFloat16": "bfloat16", "c10::Half": "float16",
           "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2", "signed char": "int8",
           "unsigned char": "uint8", "long int": "int64", "int": "int32", "short int": "int16", "bool": "bool"}
_FLOATING = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")  # widest first

# Autocast's op lists (PyTorch's "Autocast Op Reference", CUDA and CPU together): ops it runs in the low
# precision, and ops it runs in float32 on purpose. Anything else runs in its inputs' dtype.
AUTOCAST_LOWER = frozenset((
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "conv1d", "conv2d", "conv3d", "convolution",
    "_convolution", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "scaled_dot_product_attention", "chain_matmul", "linalg_vecdot", "_native_multi_head_attention",
    "mkldnn_rnn_layer", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"
))
AUTOCAST_FP32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "norm",
    "nuclear_norm", "frobenius_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "nll_loss_forward", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "sum",
    "prod", "cumprod", "cumsum", "softmax", "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss",
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "quantile", "nanquantile", "stft", "trace",
    "batch_norm"
))


def input_dtypes(prof: Any) -> dict[int, list[str]]:
    """Each op event's input dtypes by its id, read from the Kineto events: FunctionEvent.input_dtypes is newer
    than torch 2.11 (the ids are the Kineto correlation ids in both)."""
    return {k.correlation_id(): list(k.dtypes()) for k in prof.profiler.kineto_results.events()}


def dtype_of(event: Any, dtypes: dict[int, list[str]] | None = None) -> str:
    """The dtype an op computes in: the widest floating dtype among its tensor inputs (a mixed float32 ×
    float64 op runs in float64), else its first tensor input's, else "". 0-dim inputs do not count: PyTorch
    wraps Python scalars (an optimizer's ``mul_(beta)``) as 0-dim float64 tensors that promote nothing."""
    given = getattr(event, "input_dtypes", None)
    given = given if given is not None else (dtypes or {}).get(event.id, [])
    tensors = [(_DTYPES.get(d, d), bool(s)) for d, s in zip(given, event.input_shapes, strict=False)
               if d and d not in ("Scalar", "ScalarList")]
    sized = [d for d, has_dims in tensors if has_dims]
    floats = [d for d in sized if d in _FLOATING]
    if floats:
        return min(floats, key=_FLOATING.index)
    return sized[0] if sized else ""


class Marks:
    """The step's phases, timed by wall clock (synchronised on CUDA) and labelled for the profiler."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        with record_function(f"dtypelab.{phase}"):
            yield
            self.sync()
        self.seconds[phase] += time.perf_counter() - start


@dataclass
class _Unit:
    seconds: float = 0.0
    calls: int = 0
    flops: float = 0.0


@dataclass
class _Tally:
    """The profiler's events, attributed once each: a matmul/conv op with everything it calls, a cast with
    its copy, every other op by its self time."""

    cuda: bool
    dtypes: dict[int, list[str]] | None = None  # input dtypes by event id, where events lack them (torch 2.11)
    phases: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, phase), sorted
    units: dict[tuple[str, str, str, str], _Unit] = field(default_factory=lambda: defaultdict(_Unit))
    categories: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    dtype_time: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    dtype_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    scaler: float = 0.0

    def time(self, e: Any, inclusive: bool) -> float:
        if self.cuda:
            us = e.device_time_total if inclusive else e.self_device_time_total
        else:
            us = e.cpu_time_total if inclusive else e.self_cpu_time_total
        return us / 1e6

    def phase(self, e: Any) -> str:
        i = bisect.bisect_right(self.phases, (e.time_range.start, float("inf"), "")) - 1
        return self.phases[i][2] if i >= 0 and e.time_range.start <= self.phases[i][1] else ""

    def add(self, e: Any, category: str, inclusive: bool, flops: float = 0.0) -> None:
        seconds, dtype = self.time(e, inclusive), dtype_of(e, self.dtypes)
        shapes = ", ".join("×".join(map(str, s)) for s in e.input_shapes if s)
        unit = self.units[(e.name, dtype, shapes, category + ":" + self.phase(e))]
        unit.seconds += seconds
        unit.calls += 1
        unit.flops += flops
        self.categories[category] += seconds
        self.dtype_time[dtype or "none"] += seconds
        if flops:
            self.dtype_flops[dtype] += flops


def tally(events: list[Any], cuda: bool, dtypes: dict[int, list[str]] | None = None) -> _Tally:
    t = _Tally(cuda, dtypes)
    t.phases = sorted((e.time_range.start, e.time_range.end, e.name.removeprefix("dtypelab."))
                      for e in events if e.name.startswith("dtypelab."))
    for e in events:
        if not _OP.match(e.name):
            continue
        above, parent = [], e.cpu_parent
        while parent is not None:
            above.append(parent.name)
            parent = parent.cpu_parent
        if any(n in FORMULAS or n == "aten::_to_copy" for n in above):
            continue  # inside a matmul or cast already counted whole
        if e.name in _SCALER_OPS:
            t.scaler += t.time(e, True)
        if e.name in FORMULAS:
            t.add(e, "matmul", True, op_flops(e.name, e.input_shapes, e.concrete_inputs) or 0)
        elif e.name == "aten::_to_copy" and t.phase(e) != "data":
            t.add(e, "cast", True)
        else:
            t.add(e, "other", False)
    return t


def _wrapper(name: str) -> bool:
    return name in _WRAPPERS


def _peak(dtype: str, peaks: dict[str, float], tf32: bool) -> float | None:
    return peaks.get("tf32" if dtype == "float32" and tf32 else dtype)


def summarise(events: list[Any], *, mode: str, steps: int, walls: list[float], phases: dict[str, float],
              cuda: bool, peaks: dict[str, float], tf32: bool, autocast: bool, wants_fp64: bool,
              timed_step_s: float | None = None, warned: tuple[str, ...] = (),
              dtypes: dict[int, list[str]] | None = None) -> ProfileSummary:
    """The profile of ``steps`` profiled steps from the profiler's events and the phases' wall times."""
    t = tally(events, cuda, dtypes)
    step = sum(walls) / steps
    per = 1.0 / steps
    categories = {k: v * per for k, v in t.categories.items()}
    categories["outside"] = max(0.0, step - sum(categories.values()))
    ops, fp32, fp64 = [], defaultdict(_Unit), defaultdict(_Unit)
    ideal = 0.0
    for (name, dtype, shapes, where), u in t.units.items():
        category, phase = where.split(":")
        peak = _peak(dtype, peaks, tf32) if u.flops else None
        if u.flops and peak:
            ideal += u.flops / (peak * 1e9)
        ops.append(OpStat(name, u.seconds * per, u.calls * per, dtype, shapes, u.flops * per, peak, category))
        if autocast and phase == "forward" and dtype == "float32" and category != "cast" and not _wrapper(name):
            fp32[name].seconds += u.seconds * per
            fp32[name].calls += u.calls
        if not wants_fp64 and dtype == "float64":
            fp64[name].seconds += u.seconds * per
            fp64[name].calls += u.calls
    ops = _merged_top(ops)
    fp32 = {k: u for k, u in fp32.items() if u.seconds >= LISTED_SHARE * step}
    matmul_s = categories.get("matmul", 0.0)
    matmul_flops = sum(t.dtype_flops.values()) * per
    share = {k: v / step if step > 0 else 0.0 for k, v in categories.items()}
    bound = ("compute" if share.get("matmul", 0) >= 0.5 else
             "overhead" if share["outside"] >= share.get("cast", 0) + share.get("other", 0) else "memory")
    return ProfileSummary(
        mode=mode, steps=steps, device="cuda" if cuda else "cpu", step_s=step, timed_step_s=timed_step_s,
        phases={k: v * per for k, v in phases.items()}, categories=categories, scaler_s=t.scaler * per, ops=ops,
        dtype_time={k: v * per for k, v in sorted(t.dtype_time.items(), key=lambda kv: -kv[1])},
        dtype_flops={k: v * per for k, v in sorted(t.dtype_flops.items(), key=lambda kv: -kv[1])},
        matmul_flops=matmul_flops, utilisation=ideal * per / matmul_s if ideal and matmul_s > 0 else None,
        peak_gflops={k: v for k, v in peaks.items() if k in (*_FLOATING, "tf32", "int8")},
        bound=bound, fp32_under_autocast=_why_fp32(fp32, steps), fp64_ops=_listed(fp64, steps, "ran in float64"),
        warnings=warned)


def _merged_top(ops: list[OpStat]) -> tuple[OpStat, ...]:
    """One row per (op, dtypes, shapes, category) across phases, the TOP_OPS slowest."""
    merged: dict[tuple[str, str, str, str], OpStat] = {}
    for o in ops:
        key = (o.name, o.dtypes, o.shapes, o.category)
        m = merged.get(key)
        merged[key] = o if m is None else OpStat(o.name, m.seconds + o.seconds, m.calls + o.calls, o.dtypes,
                                                 o.shapes, m.flops + o.flops, o.peak_gflops, o.category)
    return tuple(sorted(merged.values(), key=lambda o: -o.seconds)[:TOP_OPS])


def _listed(units: dict[str, _Unit], steps: int, why: str | Callable[[str], str]) -> tuple[SourceOp, ...]:
    rows = sorted(units.items(), key=lambda kv: -kv[1].seconds)[:8]
    return tuple(SourceOp(name, u.seconds, u.calls / steps, why(name) if callable(why) else why)
                 for name, u in rows)


def _why_fp32(units: dict[str, _Unit], steps: int) -> tuple[SourceOp, ...]:
    def why(name: str) -> str:
        op = name.split("::", 1)[-1]
        if op in AUTOCAST_FP32:
            return "autocast runs it in float32 by design"
        if op in AUTOCAST_LOWER:
            return "autocast lowers this op, yet it ran in float32: an input came from outside autocast"
        return "not on autocast's lists: it follows its inputs, and one was float32"

    return _listed(units, steps, why)


class _Float64Sources(TorchDispatchMode):
    """Where float64 enters: an op that makes a float64 tensor from non-float64 inputs (or from none), with the
    user's line that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[tuple[str, str], SourceOp] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in outs):
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if not ins or any(a.is_floating_point() and a.dtype != torch.float64 for a in ins):
                source, code, _ = user_source()
                name = f"aten::{func.__name__.split('.')[0]}"
                if source and (name, source) not in self.sites and len(self.sites) < 8:
                    mixed = "from float32 inputs" if ins else "from Python or NumPy values"
                    self.sites[(name, source)] = SourceOp(name, 0.0, 0.0, f"makes a float64 tensor {mixed}",
                                                          source, code)
        return out


@dataclass
class Profiler:
    """Profiles steps of one model under one precision. ``run(step_fn)`` calls ``step_fn(i, marks)`` for one
    warm-up step and ``steps`` profiled ones."""

    device: torch.device
    precision: Precision
    steps: int
    peaks: dict[str, float]
    timed_step_s: float | None = None
    trace_file: str | None = None

    def run(self, mode: str, step_fn: Callable[[int, Callable[[str], Any]], None]) -> ProfileSummary:
        cuda = self.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(self.device)) if cuda else (lambda: None)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        walls: list[float] = []
        marks = Marks(sync)
        plan = self.precision.plan
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step_fn(-1, marks)  # the profiler's first step pays its start-up: not kept
                marks.seconds.clear()
                schedule = torch.profiler.schedule(wait=0, warmup=1, active=self.steps, repeat=1)
                with torch.profiler.profile(activities=activities, record_shapes=True, schedule=schedule) as prof:
                    for i in range(self.steps + 1):
                        if i == 1:
                            marks.seconds.clear()
                        sync()
                        start = time.perf_counter()
                        step_fn(i, marks)
                        sync()
                        if i >= 1:
                            walls.append(time.perf_counter() - start)
                        prof.step()
            if self.trace_file:
                prof.export_chrome_trace(self.trace_file)
            warned = tuple(dict.fromkeys(f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
                                         for w in caught if not issubclass(w.category, DeprecationWarning)
                                         and "profiler" not in w.filename.replace(os.sep, "/")))  # its own notes
            events = list(prof.events())
            dtypes = None if not events or hasattr(events[0], "input_dtypes") else input_dtypes(prof)
            summary = summarise(
                events, dtypes=dtypes, mode=mode, steps=self.steps, walls=walls, phases=dict(marks.seconds), cuda=cuda,
                peaks=self.peaks, tf32=any(c.compute_dtype == "tf32" for c in plan.configs),
                autocast=any(isinstance(c, Autocast) for c in plan.configs),
                wants_fp64=plan.compute_dtype == "float64", timed_step_s=self.timed_step_s, warned=warned[:5])
            if summary.fp64_ops:  # one more step under a dispatch mode to find where float64 came in
                finder = _Float64Sources()
                with finder:
                    step_fn(self.steps + 1, lambda phase: contextlib.nullcontext())
                summary = replace(summary, fp64_sources=tuple(finder.sites.values()))
            return replace(summary, trace_file=os.path.abspath(self.trace_file) if self.trace_file else "")
        except Exception as exc:  # the measurement stands; the record says why there is no profile
            return ProfileSummary(mode=mode, steps=self.steps, device=self.device.type, step_s=0.0,
                                  error=describe_exception(exc))


def profile_training(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer,
                     profiler: Profiler, batch_size: int, first_step: int) -> ProfileSummary:
    """Profile training steps continuing from ``first_step`` (the task's batches from there on)."""
    device = profiler.device

    def step(i: int, mark: Callable[[str], Any]) -> None:
        with mark("data"):
            inputs, target = to_device(task.batch(first_step + i + 1, batch_size), device)
        train_step(task, model, precision, optimizer, inputs, target, mark=mark)

    model.train()
    with precision.session():
        return profiler.run("train", step)


def profile_inference(model: nn.Module, precision: Precision, inputs: Any, profiler: Profiler) -> ProfileSummary:
    """Profile forward passes on ``inputs`` (already on the device)."""

    def step(i: int, mark: Callable[[str], Any]) -> None:
        with mark("forward"):
            forward(model, precision, inputs)

    with precision.session(), torch.no_grad():
        return profiler.run("infer", step)
