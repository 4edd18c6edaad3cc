"""Per-layer precision plans: measured per-layer sensitivity and gain (infer.py, train.py), the search (search.py)
and ``tune()`` (run.py); ``apply_plan`` puts a plan on your own model."""

from dtypelab.tuning.run import apply_plan, tune
from dtypelab.tuning.search import Evaluation, LayerScore, SearchResult, budget_for

__all__ = ["Evaluation", "LayerScore", "SearchResult", "apply_plan", "budget_for", "tune"]
