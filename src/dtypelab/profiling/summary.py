"""From the profiler's events to a ProfileSummary: each event attributed once (a matmul/conv op with everything
it calls, a cast with its copy, every other op by its self time), its dtype, its FLOPs, the time categories, the
top ops, float32 under autocast and float64 nobody asked for."""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.results import OpStat, ProfileSummary, SourceOp
from dtypelab.profiling.flops import FORMULAS, op_flops

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
    return peaks.get(_probe_key(dtype, tf32))


def _probe_key(dtype: str, tf32: bool) -> str:
    """The hardware probe's (and the datasheet's) key for matmuls whose inputs are ``dtype``."""
    if dtype.startswith("float8"):
        return "fp8"  # torch._scaled_mm, whichever float8 flavour
    return "tf32" if dtype == "float32" and tf32 else dtype


def mfu(dtype_flops: dict[str, float], step_s: float, rated: dict[str, float], tf32: bool
        ) -> tuple[float | None, str, float | None]:
    """(MFU, the rated key, its peak TFLOP/s): all matmul/conv FLOPs per step over ``step_s``, against the rated
    peak of the dtype that did most of them; (None, "", None) without a rated peak for it."""
    if not dtype_flops or not rated or step_s <= 0:
        return None, "", None
    dtype = max(dtype_flops, key=lambda d: dtype_flops[d])
    key = _probe_key(dtype, tf32)
    peak = rated.get(key)
    if not peak:
        return None, key, None
    return sum(dtype_flops.values()) / step_s / (peak * 1e12), key, peak


@dataclass(frozen=True)
class Against:
    """What a profile's events are read against: the device (CUDA or not, its measured and rated peaks) and what
    the policy asks of it (TF32 matmuls, autocast, float64 on purpose)."""

    cuda: bool
    peaks: dict[str, float]
    tf32: bool = False
    autocast: bool = False
    wants_fp64: bool = False
    rated: dict[str, float] | None = None


def summarise(events: list[Any], *, mode: str, steps: int, walls: list[float], phases: dict[str, float],
              against: Against, timed_step_s: float | None = None, warned: tuple[str, ...] = (),
              dtypes: dict[int, list[str]] | None = None) -> ProfileSummary:
    """The profile of ``steps`` profiled steps from the profiler's events and the phases' wall times."""
    cuda, peaks, tf32, autocast = against.cuda, against.peaks, against.tf32, against.autocast
    wants_fp64, rated = against.wants_fp64, against.rated
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
    dtype_flops = {k: v * per for k, v in sorted(t.dtype_flops.items(), key=lambda kv: -kv[1])}
    used, key, peak = mfu(dtype_flops, timed_step_s or step, rated or {}, tf32)
    bound = ("compute" if share.get("matmul", 0) >= 0.5 else
             "overhead" if share["outside"] >= share.get("cast", 0) + share.get("other", 0) else "memory")
    return ProfileSummary(
        mode=mode, steps=steps, device="cuda" if cuda else "cpu", step_s=step, timed_step_s=timed_step_s,
        phases={k: v * per for k, v in phases.items()}, categories=categories, scaler_s=t.scaler * per, ops=ops,
        dtype_time={k: v * per for k, v in sorted(t.dtype_time.items(), key=lambda kv: -kv[1])},
        dtype_flops=dtype_flops, mfu=used, mfu_key=key, rated_tflops=peak,
        matmul_flops=matmul_flops, utilisation=ideal * per / matmul_s if ideal and matmul_s > 0 else None,
        peak_gflops={k: v for k, v in peaks.items() if k in (*_FLOATING, "tf32", "int8", "fp8")},
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
