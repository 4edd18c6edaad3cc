"""Where a policy's step time goes — phases, top ops, achieved FLOP/s against the probe's peak, dtype coverage,
float64 that nobody asked for (``profile``). flops (FLOPs from op shapes) → collect (torch.profiler over a few steps)
→ summary (the events attributed and summarised); why a policy is (not) faster is judged in ``core.judging``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "profile": "run", "trace_path": "run", "PROFILE_STEPS": "options", "Profiler": "collect",
    "profile_inference": "collect", "profile_training": "collect",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.profiling.collect import Profiler, profile_inference, profile_training
    from dtypelab.profiling.options import PROFILE_STEPS
    from dtypelab.profiling.run import profile, trace_path
