"""The sweep: measure a task (or a training script) under each precision policy and decide (``bench``).

options (``BenchOptions``) → sweep (``bench()``: the plan of policies, the probe, one job per policy run by a
launcher of ``dtypelab.run``) → job (one policy's measurement on the core loop) → rounds (interleaved timing, paired
speedups) → the record, judged by ``core.judging``; budget estimates each policy's time; listing is what ``dtypelab
policies`` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "bench": "sweep", "BenchOptions": "options", "policy_table": "listing",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.sweep.listing import policy_table
    from dtypelab.sweep.options import BenchOptions
    from dtypelab.sweep.sweep import bench
