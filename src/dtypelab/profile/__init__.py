"""profile: where a policy's step time goes — phases, top ops, achieved FLOP/s against the probe's peak,
dtype coverage, float64 that nobody asked for — and why a policy is (not) faster.

flops (FLOPs from op shapes) → collect (torch.profiler over a few steps after the measurement) → summary (the
events attributed and summarised)
→ explain (a paragraph per policy against fp32's profile). Every submodule is imported here so that none can
later rebind ``dtypelab.profile``, which is the public function.
"""

from dtypelab.profile import collect, explain, flops, run, summary  # noqa: F401
from dtypelab.profile.explain import why
from dtypelab.profile.run import profile

__all__ = ["profile", "why"]
