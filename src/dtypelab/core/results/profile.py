"""Profile records: where one policy's step time goes (torch.profiler, summarised — never the raw trace).

Times are per step, averaged over the profiled steps. On CPU an op's time is its CPU time on the calling
thread (its intra-op threads included); on CUDA it is the time of the kernels it launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The step's time in four parts that add up to the step: matmul/conv ops, casts between dtypes (autocast's
# and the policy's), every other op (elementwise, reductions, norms, optimizer math), and what runs outside
# any op (Python, the autograd engine, the optimizer's loop; on CUDA: the GPU idle between kernels).
CATEGORIES = ("matmul", "cast", "other", "outside")
CATEGORY_LABELS = {"matmul": "matmul/conv", "cast": "casts", "other": "other ops", "outside": "outside ops"}
PHASES = ("data", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class OpStat:
    """One op (grouped by name, input dtypes and shapes) among those that took the most time."""

    name: str
    seconds: float  # per step: self time (matmul/conv ops: including their backend calls)
    calls: float  # per step
    dtypes: str = ""  # the floating / integer tensor inputs' dtypes, e.g. "bfloat16, bfloat16"
    shapes: str = ""
    flops: float = 0.0  # per step (matmul/conv ops only)
    peak_gflops: float | None = None  # the hardware probe's measured GFLOP/s for this op's dtype
    category: str = "other"

    @property
    def gflops(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.flops and self.seconds > 0 else None

    @property
    def utilisation(self) -> float | None:
        g = self.gflops
        return g / self.peak_gflops if g is not None and self.peak_gflops else None


@dataclass(frozen=True)
class SourceOp:
    """An op worth a look: one that ran in float64 unasked, or in float32 under autocast; ``why`` says how
    it got that dtype, ``source`` / ``code`` where the user's code made it (float64: the promotion point)."""

    op: str
    seconds: float  # per step
    calls: float
    why: str = ""
    source: str = ""
    code: str = ""


@dataclass(frozen=True)
class ProfileSummary:
    mode: str  # "train" or "infer"
    steps: int  # profiled steps
    device: str  # "cpu" or "cuda": what op times are (CPU time, or kernel time)
    step_s: float  # mean wall time of a profiled step (the profiler's own cost included)
    timed_step_s: float | None = None  # the policy's unprofiled median step, for the profiler's cost
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds per step (synchronised)
    categories: dict[str, float] = field(default_factory=dict)  # CATEGORIES -> seconds per step
    scaler_s: float = 0.0  # GradScaler's unscale/inf-check and update ops, per step (inside "optimizer")
    ops: tuple[OpStat, ...] = ()  # the top ops by time
    dtype_time: dict[str, float] = field(default_factory=dict)  # op time per input dtype, seconds per step
    dtype_flops: dict[str, float] = field(default_factory=dict)  # matmul/conv FLOPs per step by dtype
    matmul_flops: float = 0.0
    utilisation: float | None = None  # matmul/conv FLOP/s against the probe's peak for their dtypes
    peak_gflops: dict[str, float] = field(default_factory=dict)  # the probe's matmul GFLOP/s per dtype, as used
    bound: str = ""  # "compute", "overhead" or "memory"
    fp32_under_autocast: tuple[SourceOp, ...] = ()
    fp64_ops: tuple[SourceOp, ...] = ()  # ops that ran in float64 in a policy that never asked for it
    fp64_sources: tuple[SourceOp, ...] = ()  # where float64 entered: the op and the user's line
    warnings: tuple[str, ...] = ()  # PyTorch warnings raised during the profiled steps (e.g. loss broadcasting)
    # MFU: the step's matmul/conv FLOP/s (over the unprofiled median step when known) against the device's rated
    # dense peak for the dtype that did most of them (``mfu_key``: a probe key such as "bfloat16", "tf32", "fp8")
    mfu: float | None = None
    mfu_key: str = ""
    rated_tflops: float | None = None
    trace_file: str = ""  # the raw Chrome trace, when --trace-dir asked for one
    error: str = ""  # the profile failed: the measurement stands, this says why there is no profile

    @property
    def overhead(self) -> float | None:
        """The profiler's own cost: a profiled step's time over the unprofiled median, less one."""
        return self.step_s / self.timed_step_s - 1 if self.timed_step_s else None

    def share(self, seconds: float) -> float:
        return seconds / self.step_s if self.step_s > 0 else 0.0
