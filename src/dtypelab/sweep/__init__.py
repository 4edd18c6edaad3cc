"""The sweep: measure a task (or a training script) under each precision policy and decide (``bench``).

sweep (``bench()``: options, plan of policies, probe) → job (one policy's measurement on the core loop, run by a
launcher of ``dtypelab.run``) → rounds (interleaved timing, paired speedups) → the record, judged by
``core.judging``; budget estimates each policy's time; listing is what ``dtypelab policies`` prints.
"""

from dtypelab.sweep.listing import policy_table
from dtypelab.sweep.sweep import bench

__all__ = ["bench", "policy_table"]
