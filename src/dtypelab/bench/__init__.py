"""bench: measure a task under each policy and recommend one.

sweep (the ``bench()`` entry point) → launch (how a job runs: inline, child process) → job (one
policy's measurement on the core loop) → recommend (verdicts from a record); listing is what ``dtypelab
policies`` prints. Every submodule is imported here so that none can later rebind ``dtypelab.bench``, which is
the public function.
"""

from dtypelab.bench import job, launch, listing, recommend, sweep  # noqa: F401
from dtypelab.bench.listing import policy_table
from dtypelab.bench.recommend import Recommendation, Tolerance
from dtypelab.bench.sweep import bench

__all__ = ["Recommendation", "Tolerance", "bench", "policy_table"]
