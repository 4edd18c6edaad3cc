"""GradScaler diagnostics: scale history, skipped steps, the parameters whose gradients were non-finite
on those steps, and a warning when the scale collapses. Shared by ``bench`` (amp-fp16) and ``trace``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

COLLAPSE_BELOW = 1.0  # a scale below 1 means gradients overflow float16 even unscaled
MAX_NAMES = 10  # parameters listed per skipped step (the count is always kept)
MAX_SKIPS = 50  # skipped steps described in full (all are counted)


class ScalerLog:
    """Feed it the scale before and after each optimizer step; it records what GradScaler did."""

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]] = ()) -> None:
        self.params = list(named_parameters)
        self.scales: list[float] = []  # scale used for each step's backward
        self.skips: list[dict[str, Any]] = []
        self.skipped = 0
        self.collapse_step: int | None = None

    def record(self, step: int, scale_before: float, scale_after: float) -> bool:
        """Log one step; True when the step was skipped. GradScaler has no skip flag, but it backs the
        scale off exactly when it found inf/NaN gradients and skipped the update."""
        self.scales.append(scale_before)
        skipped = scale_after < scale_before
        if skipped:
            self.skipped += 1
            if len(self.skips) < MAX_SKIPS:
                bad = self.nonfinite_grads()
                self.skips.append({"step": step, "scale": scale_before, "nonfinite_params": bad[:MAX_NAMES],
                                   "n_nonfinite_params": len(bad)})
        if scale_after < COLLAPSE_BELOW and self.collapse_step is None:
            self.collapse_step = step
        return skipped

    def nonfinite_grads(self) -> list[str]:
        """Parameters whose gradient holds inf/NaN now (after a skipped step the gradients are still there)."""
        return [n for n, p in self.params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]

    def stats(self) -> dict[str, Any]:
        return {"grad_scale": list(self.scales), "skipped_steps": self.skipped,
                "first_skipped_step": self.skips[0]["step"] if self.skips else None, "skips": list(self.skips),
                "min_scale": min(self.scales) if self.scales else None, "collapse_step": self.collapse_step}


def scaler_notes(stats: dict[str, Any], steps: int, label: str = "") -> list[str]:
    """Plain-language lines about a GradScaler history (empty when there is none)."""
    if not stats or "grad_scale" not in stats:
        return []
    prefix = f"{label}: " if label else ""
    scales, skipped = stats["grad_scale"], stats.get("skipped_steps", 0)
    notes = []
    if skipped:
        text = (f"{prefix}GradScaler skipped {skipped} of {steps} steps (first at step {stats['first_skipped_step']}), "
                f"final scale {scales[-1]:g}" if scales else "")
        skips = stats.get("skips") or []
        if skips and skips[0].get("nonfinite_params"):
            first = skips[0]
            names = ", ".join(first["nonfinite_params"][:3])
            more = first["n_nonfinite_params"] - min(3, len(first["nonfinite_params"]))
            text += f"; non-finite gradients at step {first['step']} in {names}" + (f" and {more} more" if more > 0
                                                                                      else "")
        notes.append(text)
    collapse = stats.get("collapse_step")
    if "collapse_step" not in stats:  # records written before it was kept: the scale history shows it a step later
        collapse = next((i - 1 for i, s in enumerate(scales) if s < COLLAPSE_BELOW), None)
    if collapse is not None:
        lowest = stats.get("min_scale") if stats.get("min_scale") is not None else min(scales)
        notes.append(f"{prefix}warning: the loss scale collapsed below {COLLAPSE_BELOW:g} (step {collapse}, minimum "
                     f"{lowest:g}): gradients overflow float16 even unscaled, a sign of float16 overflow in the "
                     "forward pass; `dtypelab trace TASK --policy amp-fp16` finds the op")
    return notes
