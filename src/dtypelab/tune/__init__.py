"""tune: per-layer precision plans for inference — measured per-layer sensitivity and gain (infer.py), the search
(search.py) and ``tune()`` (run.py); ``apply_plan`` puts a plan on your own model. Every submodule is imported
here so that none can later rebind ``dtypelab.tune``, which is the public function. Training plans are not tuned
yet (issue #15 continues)."""

from dtypelab.tune import infer, run, search  # noqa: F401
from dtypelab.tune.run import apply_plan, tune
from dtypelab.tune.search import Evaluation, LayerScore, SearchResult, budget_for

__all__ = ["Evaluation", "LayerScore", "SearchResult", "apply_plan", "budget_for", "tune"]
