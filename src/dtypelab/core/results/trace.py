"""Trace records: where the first NaN/Inf of a training run came from, and GradScaler's history."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results.store import SCHEMA_VERSION, check_schema, from_json_safe, json_safe, save_text

TRACE_SCHEMA = "dtypelab.trace.run"


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpEvent:
        def ts(x: dict[str, Any]) -> TensorSummary:
            return TensorSummary(**{**x, "shape": tuple(x["shape"])})
        return cls(**{**d, "inputs": tuple(ts(x) for x in d["inputs"]), "outputs": tuple(ts(x) for x in d["outputs"])})


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(**{**d, "origin": OpEvent.from_dict(d["origin"]) if d.get("origin") else None,
                      "path": tuple(d.get("path", ())), "reached": tuple(d.get("reached", ())),
                      "others": tuple(OpEvent.from_dict(e) for e in d.get("others", ()))})


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


@dataclass(frozen=True)
class TraceReport:
    config: TraceConfig
    environment: dict[str, Any]
    status: str  # "clean", "found", "failed" or "interrupted"
    reason: str = ""
    finding: Finding | None = None
    losses: tuple[float, ...] = ()
    scaler: dict[str, Any] = field(default_factory=dict)  # GradScaler history (amp-fp16)
    checkpoint_every: int = 0  # the interval used
    checkpoint_s: float = 0.0  # time to take one checkpoint
    wall_s: float = 0.0
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps({"schema": TRACE_SCHEMA, **json_safe(asdict(self))}, indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceReport:
        check_schema(d, TRACE_SCHEMA)
        d = from_json_safe(d)
        d.pop("schema")
        try:
            return cls(**{**d, "config": TraceConfig(**d["config"]), "losses": tuple(d.get("losses", ())),
                          "finding": Finding.from_dict(d["finding"]) if d.get("finding") else None})
        except (KeyError, TypeError) as exc:
            raise DtypelabError(f"trace file is malformed: {exc}") from exc

    def save(self, path: str) -> None:
        save_text(path, self.to_json())
