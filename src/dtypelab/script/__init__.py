"""script: measure the user's own training — a plain PyTorch script through ``dtypelab.session()``, a
LightningModule through ``dtypelab.lightning.Trainer``, a Hugging Face model through ``dtypelab.hf.Trainer`` —
once per policy, each run in its own process (runner), with the same record, table and recommendation as a
Task gets."""

from dtypelab.core.task import is_script
from dtypelab.script import runner, session  # noqa: F401
from dtypelab.script.runner import bench_script
from dtypelab.script.session import Session

__all__ = ["Session", "bench_script", "is_script"]
