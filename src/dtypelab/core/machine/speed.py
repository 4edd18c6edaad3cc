"""The time model: a step's time from the ops a forecast traced, against a device's rates.

Each op a trace saw is an ``Op``: its FLOPs (torch's ``flop_counter`` formulas: matmuls, convolutions, attention,
``_scaled_mm``), the bytes it reads and writes, and the rate it computes at (``float32``, ``tf32``, ``bfloat16``,
``float16``, ``fp8``, ``int8``, ``float64``: what the trace saw it run in). Its time is a roofline with a floor:

    time = max(FLOPs / (peak × efficiency), bytes / bandwidth, per-kernel floor)

summed over the step. ``efficiency`` is 1 for rates measured on the machine itself (the CPU's probe times its own
matmuls), and on a GPU a curve of the GEMM's size: small GEMMs run far from the datasheet's peak (``GEMM_EFFICIENCY``,
from measurements, sourced below). A compiled policy fuses each run of elementwise ops into one kernel: it reads what
the run takes from outside and writes what leaves it, and pays one floor (``fuse``).

Every op is also put in a group for the breakdown: matmuls, attention, convolutions, elementwise, casts (dtype
conversions and float8/MX scaling), optimizer (the update).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from dtypelab.core.machine.devices import DeviceSpec
from dtypelab.core.machine.hardware import HardwareInfo

# GEMM efficiency on an H100 SXM (achieved / the datasheet's dense bfloat16 peak, 989.5 TFLOP/s) against
# log2(M·N·K): the median, per whole power of two, of the 375 bfloat16 entries (b 1–4, M, N, K 256–4096) of XLA's
# measured matmul table for sm_90 (openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h, Apache-2.0; the
# copy read is ROCm/xla at e97611c, 2026-02-13). Its float32 entries ran as TF32 and its float8 entries exceed the
# datasheet's dense peak (2.59 against 1.98 PFLOP/s), so only the bfloat16 ones are used: the same curve is applied
# to every tensor-core rate of every GPU, against that rate's own peak. The curve's low end is launch overhead (a
# 256³ GEMM takes ~5 µs whatever its dtype).
GEMM_EFFICIENCY: tuple[tuple[float, float], ...] = (
    (24, 0.007), (25, 0.012), (26, 0.024), (27, 0.044), (28, 0.083), (29, 0.144), (30, 0.234), (31, 0.350),
    (32, 0.479), (33, 0.608), (34, 0.729), (35, 0.732), (36, 0.779), (37, 0.811), (38, 0.797),
)
GEMM_SOURCE = "XLA's measured sm_90 matmul table (bfloat16, median per size)"
# A rowwise-scaled float8 GEMM (torch._scaled_mm with a scale per row and per column: a CUTLASS kernel in PyTorch,
# where a tensorwise one calls cuBLAS) against a tensorwise one of the same shape, fast accumulation, on an H100:
# "most shapes are within 90-100% of tensor-wise efficiency, but there's a long tail going down to 50%" (pytorch/
# pytorch#147971, 2025-02-26, after the tile heuristics of pytorch/pytorch#134781). The low end of "most" is taken.
# torchao's slow-accumulation backward GEMMs run cuBLAS with the scales applied after (pytorch/ao#1325): their calls
# carry tensor scales, and are timed as tensorwise ones, with their rescaling as the elementwise ops it is.
ROWWISE_EFFICIENCY = 0.9
# A flash-attention kernel (what SDPA runs on a GPU) against the dense bfloat16 peak, forward and backward together, in
# useful FLOPs (a causal mask's skipped half not counted): FlashAttention-2, the kernel behind PyTorch's SDPA, reaches
# "only 35% utilization on H100" (Shah et al., FlashAttention-3, arXiv 2407.08608, abstract: it cannot use Hopper's
# asynchronous tensor cores); on an A100 its forward and backward together reach about 60% (Dao, FlashAttention-2,
# arXiv 2307.08691, section 4.1: 187-203 of 312 TFLOP/s at head dimension 128, 8k-16k tokens). A GPU before
# Hopper takes the A100's share. torch's flop counter counts a causal call's full FLOPs: its useful half is timed.
ATTENTION_EFFICIENCY = {(9, 0): 0.35, (8, 0): 0.60}
GROUPS = ("matmuls", "attention", "convolutions", "elementwise", "casts", "optimizer")
BOUNDS = ("compute", "memory", "overhead")


@dataclass(frozen=True)
class Op:
    """One kernel a step runs, as the trace saw it."""

    group: str  # one of GROUPS
    rate: str  # the rate its FLOPs run at ("" for an op with none)
    flops: float = 0.0
    reads: tuple[tuple[int, int], ...] = ()  # (storage, bytes) it reads
    writes: tuple[tuple[int, int], ...] = ()  # (storage, bytes) it writes
    work: float = 0.0  # M·N·K of a GEMM (its size on the efficiency curve); 0 for others
    fusible: bool = False  # elementwise: a compiled step fuses runs of these
    dtype: str = ""  # what it writes (an elementwise op's speed on a CPU depends on it)
    module: str = ""  # the innermost module running it ("" outside any)
    # a matmul's, attention's or convolution's call as it ran (aten op, overload, its arguments with each tensor as a
    # ``TensorSpec``): a device whose rates time kernels where they run (this CPU) times it at exactly this call
    kernel: tuple = ()
    variant: str = ""  # a GEMM kernel family slower than the plain one at the same rate ("rowwise": rowwise-scaled)
    causal: bool = False  # attention under a causal mask: half its counted FLOPs are skipped

    @property
    def read(self) -> int:
        return sum(b for _, b in self.reads)

    @property
    def written(self) -> int:
        return sum(b for _, b in self.writes)


@dataclass(frozen=True)
class Rates:
    """What a device does per second: FLOPs per rate key (dense peaks, or measured), bytes of memory traffic, and the
    least time one kernel takes."""

    device: str
    flops: dict[str, float]  # FLOP/s per rate key
    bandwidth: float  # bytes/s
    floor_s: float  # per kernel
    # GEMM efficiency by log2(M·N·K), per rate key ("*": every key without its own); none: flat (1)
    curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = ""
    bandwidths: dict[str, float] = field(default_factory=dict)  # bytes/s of an elementwise op per dtype, where measured
    # each GEMM variant's efficiency against the plain kernel's at the same size (GPU: ROWWISE_EFFICIENCY)
    variants: dict[str, float] = field(default_factory=dict)
    times_kernels: bool = False  # the device is this machine: its heavy kernels are timed at their own calls
    kernels: dict[tuple, float] = field(default_factory=dict)  # seconds of each kernel timed (``Op.kernel`` -> s)
    attention: float = 1.0  # a flash-attention kernel's share of the peak (GPU: ATTENTION_EFFICIENCY); 1: measured

    def efficiency(self, work: float, rate: str = "*") -> float:
        """The share of the rate a GEMM of M·N·K = ``work`` reaches (piecewise linear in log2(work))."""
        curve = self.curves.get(rate) or self.curves.get("*")
        if not curve or work <= 0:
            return 1.0
        x = math.log2(work)
        if x <= curve[0][0]:
            return curve[0][1] * 2 ** (x - curve[0][0])  # smaller still: the same time for less work
        for (x0, y0), (x1, y1) in itertools.pairwise(curve):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return curve[-1][1]


@dataclass
class Timing:
    """A step's predicted time, where it goes (by group) and what bounds it (seconds per bound)."""

    step_s: float = 0.0
    groups: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    bounds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BOUNDS, 0.0))
    kernels: int = 0
    missing: tuple[str, ...] = ()  # rate keys the device has no figure for (the op was timed at float32's)

    @property
    def bound(self) -> str:
        """What most of the time is bound by."""
        return max(self.bounds, key=lambda b: self.bounds[b]) if self.step_s else ""


class NoRate(ValueError):
    """The device has no rate for a dtype a policy computes in (fp8 on an A100)."""


def op_time(op: Op, rates: Rates) -> tuple[float, str]:
    """(seconds, what bounds it) of one op."""
    measured = rates.kernels.get(op.kernel) if op.kernel else None
    if measured is not None:  # timed at its own call on the device: arithmetic, memory and dispatch all in it
        return max(measured, rates.floor_s), "compute" if measured >= rates.floor_s else "overhead"
    compute = 0.0
    if op.flops:
        peak = rates.flops.get(op.rate)
        if not peak:
            raise NoRate(op.rate)
        if op.group == "attention":
            compute = op.flops * (0.5 if op.causal else 1.0) / (peak * rates.attention)
        else:
            compute = op.flops / (peak * rates.efficiency(op.work, op.rate) * rates.variants.get(op.variant, 1.0))
    memory = (op.read + op.written) / rates.bandwidths.get(op.dtype, rates.bandwidth)
    t = max(compute, memory, rates.floor_s)
    return t, "compute" if t == compute else "memory" if t == memory else "overhead"


def fuse(ops: Sequence[Op]) -> list[Op]:
    """What a compiled step runs: each run of fusible ops becomes one kernel that reads what the run takes from
    outside it (before writing it) and writes what leaves it (read by a later op outside the run, or by none: a
    result the step keeps)."""
    last_read: dict[int, int] = {}  # storage -> the last op reading it
    for i, op in enumerate(ops):
        for s, _ in op.reads:
            last_read[s] = i
    out: list[Op] = []
    i = 0
    while i < len(ops):
        if not ops[i].fusible:
            out.append(ops[i])
            i += 1
            continue
        j = i
        while j + 1 < len(ops) and ops[j + 1].fusible:
            j += 1
        made: dict[int, int] = {}
        taken: dict[int, int] = {}
        for op in ops[i:j + 1]:
            for s, b in op.reads:
                if s not in made:
                    taken[s] = max(taken.get(s, 0), b)
            for s, b in op.writes:
                made[s] = max(made.get(s, 0), b)
        left = {s: b for s, b in made.items() if last_read.get(s, j + 1) > j}
        moved: dict[str, int] = {}  # the fused kernel counts as the group that moved most of its ops' bytes
        for op in ops[i:j + 1]:
            moved[op.group] = moved.get(op.group, 0) + op.read + op.written
        group = max(moved, key=lambda g: moved[g])
        biggest = max(ops[i:j + 1], key=lambda op: op.read + op.written)  # and as that op's module's
        out.append(Op(group, "", sum(op.flops for op in ops[i:j + 1]), tuple(taken.items()), tuple(left.items()),
                      fusible=True, dtype=ops[j].dtype, module=biggest.module))
        i = j + 1
    return out


def step_time(ops: Iterable[Op], rates: Rates, compiled: bool = False) -> Timing:
    """The predicted time of the ops (fused first when ``compiled``)."""
    ops = list(ops)
    timing = Timing()
    missing = set()
    for op in fuse(ops) if compiled else ops:
        try:
            t, bound = op_time(op, rates)
        except NoRate:
            missing.add(op.rate)
            t, bound = op_time(replace(op, rate="float32"), rates)
        timing.step_s += t
        timing.groups[op.group] += t
        timing.bounds[bound] += t
        timing.kernels += 1
    timing.missing = tuple(sorted(missing))
    return timing


# --- a device's rates -------------------------------------------------------------------------------------------------
# The share of a GPU's datasheet bandwidth an elementwise kernel reaches: torchao's float8 roofline takes 0.92
# ("pointwise triton kernels with large inputs" on an H100; torchao/testing/training/roofline_utils.py).
GPU_BANDWIDTH_SHARE = 0.92
# The least time one kernel takes on a GPU: the smallest GEMM of XLA's sm_90 table (256³, bfloat16) took 5.0 µs.
GPU_FLOOR_S = 5.0e-6
PROBE_N = 256  # the CPU probe's matmul size (core.machine.hardware.probe)


def gpu_rates(spec: DeviceSpec) -> Rates:
    """A GPU of the device table: its datasheet peaks (times the GEMM efficiency curve) and bandwidth."""
    source, peaks = spec.peaks
    if not peaks or not spec.bandwidth_gbs:
        raise NoRate(f"no datasheet peaks or bandwidth for {spec.label}")
    return Rates(spec.label, {k: v * 1e12 for k, v in peaks.items()}, spec.bandwidth_gbs * 1e9 * GPU_BANDWIDTH_SHARE,
                 GPU_FLOOR_S, {"*": GEMM_EFFICIENCY},
                 f"{source}; {spec.bandwidth_gbs:g} GB/s × {GPU_BANDWIDTH_SHARE} (torchao's achievable share); GEMM "
                 f"efficiency: {GEMM_SOURCE}, rowwise-scaled float8 × {ROWWISE_EFFICIENCY} (pytorch/pytorch#147971); "
                 f"{GPU_FLOOR_S * 1e6:g} µs per kernel at least; flash attention at "
                 f"{attention_efficiency(spec.capability):.0%} of the peak (FlashAttention-2 and -3's papers)",
                 variants={"rowwise": ROWWISE_EFFICIENCY}, attention=attention_efficiency(spec.capability))


def attention_efficiency(capability: tuple[int, int] | None) -> float:
    """The flash-attention share of the peak for a GPU of this compute capability (Hopper and later: the H100's)."""
    return ATTENTION_EFFICIENCY[(9, 0) if capability is not None and capability >= (9, 0) else (8, 0)]


def cpu_rates(hw: HardwareInfo) -> Rates:
    """This machine's CPU as the probe measured it: its matmul GFLOP/s per dtype at the probe's size and below it (the
    efficiency curve of each), its copy bandwidth and one small op's time."""
    if not hw.bandwidth_gbs or not hw.op_floor_us:
        raise NoRate("this hardware probe has no bandwidth or per-op time (made by an older dtypelab): run "
                     "`dtypelab hardware` again")
    keys = ("float64", "float32", "bfloat16", "float16", "int8")
    flops = {k: hw.gflops[k] * 1e9 for k in keys if hw.gflops.get(k)}
    curves = {}
    for key, small in hw.small_gflops.items():
        if hw.gflops.get(key):
            points = sorted((3 * math.log2(int(n)), min(1.0, g / hw.gflops[key])) for n, g in small.items())
            curves[key] = (*points, (3 * math.log2(PROBE_N), 1.0))
    elementwise = {k: v * 1e9 for k, v in hw.elementwise_gbs.items() if v}
    return Rates(hw.cpu_name or "cpu", flops, hw.bandwidth_gbs * 1e9, hw.op_floor_us * 1e-6, curves,
                 "measured here: each matmul, attention and convolution timed at its own call (square matmuls per "
                 f"dtype, n = 16 to {PROBE_N}, for any not timed), {hw.bandwidth_gbs:.1f} GB/s copy bandwidth"
                 + (f", elementwise {', '.join(f'{k} {v:.0f}' for k, v in hw.elementwise_gbs.items())} GB/s"
                    if elementwise else "") + f", {hw.op_floor_us:.1f} µs per op of a tiny training step",
                 elementwise, times_kernels=True)


def float8_layers(ops: Sequence[Op], rates: Rates) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """For each module whose matmuls ran in float8: (its name, the time float8 saves there net of its casts and
    scaling), split into those that pay and those that lose. What it saves: its float8 matmuls timed as bfloat16
    ones (operands twice the bytes, bfloat16's rate) against as they are; what it costs: its casts' time."""
    saved: dict[str, float] = {}
    for op in ops:
        if not op.module:
            continue
        if op.group == "matmuls" and op.rate == "fp8":
            as_bf16 = replace(op, rate="bfloat16", variant="", reads=tuple((s, 2 * b) for s, b in op.reads))
            saved[op.module] = saved.get(op.module, 0.0) + op_time(as_bf16, rates)[0] - op_time(op, rates)[0]
    for op in ops:
        if op.module in saved and op.group == "casts":
            saved[op.module] -= op_time(op, rates)[0]
    pays = sorted(((m, s) for m, s in saved.items() if s > 0), key=lambda x: -x[1])
    loses = sorted(((m, s) for m, s in saved.items() if s <= 0), key=lambda x: x[1])
    return pays, loses
