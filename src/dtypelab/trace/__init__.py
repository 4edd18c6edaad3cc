"""trace: the NaN/Inf guard, the op-level tracer that finds the first non-finite value, and diagnoses.

Every submodule is imported here so that none can later rebind ``dtypelab.trace``, the public function.
"""

from dtypelab.trace import diagnose, guard, nonfinite, run  # noqa: F401
from dtypelab.trace.guard import Guard, NonFiniteError, watch
from dtypelab.trace.run import trace

__all__ = ["Guard", "NonFiniteError", "trace", "watch"]
