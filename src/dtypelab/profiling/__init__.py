"""Where a policy's step time goes — phases, top ops, achieved FLOP/s against the probe's peak, dtype coverage,
float64 that nobody asked for (``profile``). flops (FLOPs from op shapes) → collect (torch.profiler over a few
steps) → summary (the events attributed and summarised); why a policy is (not) faster is judged in
``core.judging``."""

from dtypelab.profiling.collect import Profiler, profile_inference, profile_training
from dtypelab.profiling.run import PROFILE_STEPS, profile, trace_path

__all__ = ["PROFILE_STEPS", "Profiler", "profile", "profile_inference", "profile_training", "trace_path"]
