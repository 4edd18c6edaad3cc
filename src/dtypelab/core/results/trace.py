"""Trace records: where the first NaN/Inf of a training run came from, and GradScaler's history."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.results.parts import ScalerStats
from dtypelab.core.results.store import Record

TRACE_SCHEMA = "dtypelab.trace"
TRACE_VERSION = 2


@dataclass(frozen=True)
class TensorSummary:
    dtype: str
    shape: tuple[int, ...]
    min: float | None  # over finite values; None when there are none
    max: float | None
    nan: int
    posinf: int
    neginf: int
    zeros: int

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True)
class OpEvent:
    """One op that created non-finite values (or an input that already held them)."""

    index: int  # order within the traced step
    step: int | None
    phase: str  # "forward", "backward", "optimizer", or "input" (non-finite before the step)
    op: str  # aten name, e.g. "aten.exp"
    kind: str  # "origin" (an error), "mask" (an intentional ±inf) or "external" (came in non-finite)
    module: str  # full module path; for backward ops, the module whose forward op this is the backward of
    source: str  # "file.py:42" of the user's line that called the (forward) op
    code: str  # that line's text
    backward_of: str  # backward ops: the forward op, e.g. "aten.sqrt"
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    diagnosis: str
    tensor: str = ""  # a named tensor written (parameter, optimizer state), or the named input
    via: str = ""  # when ``source`` is not the line that runs the op: how it leads there



@dataclass(frozen=True)
class Finding:
    step: int
    trigger: str  # what the cheap check saw, e.g. "loss is nan"
    reproduced: bool  # the replay from the checkpoint produced the non-finite value again
    origin: OpEvent | None
    path: tuple[str, ...] = ()  # ops the value propagated through after the origin
    reached: tuple[str, ...] = ()  # what the detector saw it in: "loss", "fc.weight (parameter)", …
    others: tuple[OpEvent, ...] = ()  # other origins in the step (e.g. NaN made and then discarded)
    masks: int = 0  # intentional infinities seen in the step (not errors)
    checkpoint_step: int = 0
    replayed_steps: int = 0
    trace_s: float = 0.0
    ops_traced: int = 0
    # (step, max |w| over all parameters) at each checkpoint and at the start of the failing step: weights that
    # grow by orders of magnitude point at the learning rate, not at the op that finally overflowed
    weight_max: tuple[tuple[int, float], ...] = ()



@dataclass(frozen=True)
class TraceConfig:
    task: str
    policy: str
    steps: int
    batch_size: int
    seed: int
    device: str
    checkpoint_every: int  # 0: chosen from the measured cost of a checkpoint
    stop_on_skip: bool
    task_name: str = ""  # Task.name (``task`` is how it was given)


@dataclass(frozen=True)
class TraceReport(Record):
    config: TraceConfig
    environment: dict[str, Any]
    status: str  # "clean", "found", "failed" or "interrupted"
    reason: str = ""
    finding: Finding | None = None
    losses: tuple[float, ...] = ()
    scaler: ScalerStats = field(default_factory=dict)  # GradScaler history (amp-fp16)
    checkpoint_every: int = 0  # the interval used
    checkpoint_s: float = 0.0  # time to take one checkpoint
    # a training script, traced as it ran (no checkpoint): every step, or (finding.replayed_steps > 0) a second run of
    # the script from the same seed, untraced up to the step the first run went non-finite at
    live: bool = False
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = TRACE_VERSION

    schema = TRACE_SCHEMA
    version = TRACE_VERSION
