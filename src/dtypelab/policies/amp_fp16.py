"""Autocast to float16 with a GradScaler, recording the scale and skipped steps."""

from __future__ import annotations

from typing import Any

import torch

from .base import AutocastPolicy


class AmpFP16(AutocastPolicy):
    name = "amp-fp16"
    summary = "torch.autocast(float16) + GradScaler, float32 weights"
    compute_dtype = "float16"
    dtype = torch.float16

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(self.device.type)
        self.scales: list[float] = []  # scale used for each step's backward
        self.skipped: list[int] = []  # steps whose update was skipped for inf/NaN gradients
        self._step = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler exposes no skip flag; it backs the scale off exactly when it skipped the step.
        stepped = self.scaler.get_scale() >= scale
        self.scales.append(scale)
        if not stepped:
            self.skipped.append(self._step)
        self._step += 1
        return stepped

    def stats(self) -> dict[str, Any]:
        return {
            "grad_scale": list(self.scales),
            "skipped_steps": len(self.skipped),
            "first_skipped_step": self.skipped[0] if self.skipped else None,
        }
