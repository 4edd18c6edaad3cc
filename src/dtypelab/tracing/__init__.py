"""The NaN/Inf guard, the op-level tracer that finds the first non-finite value, and its diagnoses (``trace``,
on ``TraceOptions``; on a training script, the tracer rides its own loop: ``TraceDiagnosis``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "trace": "run", "TraceOptions": "options", "Guard": "guard", "NonFiniteError": "guard", "watch": "guard",
    "Snapshot": "snapshot", "all_finite": "snapshot", "trace_forward": "guard", "checkpoint_interval": "snapshot",
    "CHECKPOINT_BUDGET": "snapshot",
    "TraceDiagnosis": "script",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.tracing.guard import Guard, NonFiniteError, trace_forward, watch
    from dtypelab.tracing.options import TraceOptions
    from dtypelab.tracing.run import trace
    from dtypelab.tracing.script import TraceDiagnosis
    from dtypelab.tracing.snapshot import CHECKPOINT_BUDGET, Snapshot, all_finite, checkpoint_interval
