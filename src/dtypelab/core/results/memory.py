"""Where memory goes, by category: the one list every record, counter and renderer of memory uses.

``frozen_weights`` are the weights that do not train (a fine-tuned model's base: LoRA, QLoRA); ``parameters`` the
ones that do. ``loss``: a language model's logits, their float32 copies, log-probabilities and gradients (every
tensor as wide as its vocabulary), apart from the activations and temporaries they would otherwise be counted in: at
a 128k vocabulary they can hold more than all of a checkpointed model's activations. The forecast's peak has all
nine, in the order shown (what the model holds, then what the step adds); bench counts the six it can take from the
tensors after a run (``COUNTED``: no buffers, and no temporaries, which are gone by then)."""

from __future__ import annotations

MEMORY_CATEGORIES = ("frozen_weights", "parameters", "buffers", "gradients", "optimizer_state", "master_weights",
                     "activations", "loss", "temporaries")
COUNTED = ("frozen_weights", "parameters", "gradients", "optimizer_state", "master_weights", "activations")
# each category's short name, in tables and charts
MEMORY_LABELS = {"frozen_weights": "frozen", "parameters": "weights", "buffers": "buffers", "gradients": "gradients",
                 "optimizer_state": "optimizer", "master_weights": "master", "activations": "activations",
                 "loss": "loss", "temporaries": "temporaries"}

__all__ = ["COUNTED", "MEMORY_CATEGORIES", "MEMORY_LABELS"]
