"""The NaN/Inf guard, the op-level tracer that finds the first non-finite value, and its diagnoses (``trace``)."""

from dtypelab.tracing.guard import Guard, NonFiniteError, watch
from dtypelab.tracing.run import trace

__all__ = ["Guard", "NonFiniteError", "trace", "watch"]
