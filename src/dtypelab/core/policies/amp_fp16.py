"""Autocast to float16 with a GradScaler, recording the scale, skipped steps and their non-finite gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtypelab.core.policies.base import AutocastPolicy
from dtypelab.core.scaler import ScalerLog


class AmpFP16(AutocastPolicy):
    name = "amp-fp16"
    summary = "torch.autocast(float16) + GradScaler, float32 weights"
    compute_dtype = "float16"
    dtype = torch.float16

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(self.device.type)
        self.log = ScalerLog()
        self._step = 0

    def convert_module(self, model: nn.Module) -> nn.Module:
        self.log.params = list(model.named_parameters())  # to name the parameters on skipped steps
        return model

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.log.record(self._step, scale, self.scaler.get_scale())
        self._step += 1
        return not skipped

    def stats(self) -> dict[str, Any]:
        return self.log.stats()
