"""Where memory goes, by category: the one list every record, counter and renderer of memory uses.

``frozen_weights`` are the weights that do not train (a fine-tuned model's base: LoRA, QLoRA); ``parameters`` the
ones that do. The forecast's peak has all eight, in the order shown (what the model holds, then what the step adds);
bench counts the six it can take from the tensors after a run (``COUNTED``: no buffers, and no temporaries, which
are gone by then)."""

from __future__ import annotations

MEMORY_CATEGORIES = ("frozen_weights", "parameters", "buffers", "gradients", "optimizer_state", "master_weights",
                     "activations", "temporaries")
COUNTED = ("frozen_weights", "parameters", "gradients", "optimizer_state", "master_weights", "activations")
# each category's short name, in tables and charts
MEMORY_LABELS = {"frozen_weights": "frozen", "parameters": "weights", "buffers": "buffers", "gradients": "gradients",
                 "optimizer_state": "optimizer", "master_weights": "master", "activations": "activations",
                 "temporaries": "temporaries"}

__all__ = ["COUNTED", "MEMORY_CATEGORIES", "MEMORY_LABELS"]
