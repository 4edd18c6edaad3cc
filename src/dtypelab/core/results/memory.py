"""Where memory goes, by category: the one list every record, counter and renderer of memory uses.

The forecast's peak has all seven, in the order shown (what the model holds, then what the step adds); bench counts
the five it can take from the tensors after a run (``COUNTED``: no buffers, and no temporaries, which are gone by
then)."""

from __future__ import annotations

MEMORY_CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "master_weights", "activations",
                     "temporaries")
COUNTED = ("parameters", "gradients", "optimizer_state", "master_weights", "activations")
# each category's short name, in tables and charts
MEMORY_LABELS = {"parameters": "weights", "buffers": "buffers", "gradients": "gradients",
                 "optimizer_state": "optimizer", "master_weights": "master", "activations": "activations",
                 "temporaries": "temporaries"}

__all__ = ["COUNTED", "MEMORY_CATEGORIES", "MEMORY_LABELS"]
