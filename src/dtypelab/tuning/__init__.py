"""Per-layer precision plans: measured per-layer sensitivity and gain (infer, train), the search (search) and
``tune()`` (run, on ``TuneOptions``); ``apply_plan`` puts a plan on your own model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtypelab.core.lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "tune": "run", "apply_plan": "run", "TuneOptions": "options", "Evaluation": "search", "LayerScore": "search",
    "SearchResult": "search", "budget_for": "search", "TUNES": "adapters", "LAYER_TYPES": "adapters",
    "RANGE_DTYPE": "adapters",
})

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from dtypelab.tuning.adapters import LAYER_TYPES, RANGE_DTYPE, TUNES
    from dtypelab.tuning.options import TuneOptions
    from dtypelab.tuning.run import apply_plan, tune
    from dtypelab.tuning.search import Evaluation, LayerScore, SearchResult, budget_for
