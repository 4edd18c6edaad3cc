"""The precision-policy interface: hooks that default to no-ops, overridden per policy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.task import map_tensors


@dataclass(frozen=True)
class Availability:
    """Whether a policy can run here; ``slow`` means it can but was measured pathologically slow."""

    ok: bool
    reason: str = ""
    slow: bool = False


class Policy:
    """One way to run a model's numerics. Subclasses override only the hooks they need.

    Order of use in a training step: ``session()`` around the whole run (process-wide flags),
    ``convert_module`` once, then per step ``convert_inputs`` -> ``forward_context`` (forward + loss)
    -> ``backward`` -> ``optimizer_step``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    compute_dtype: ClassVar[str] = "float32"  # what the matmuls run in; the probe's throughput key
    modes: ClassVar[tuple[str, ...]] = ("train", "infer")  # quantized policies are inference-only
    backend: ClassVar[str] = "torch"
    arithmetic: ClassVar[str] = ""  # for formats that need saying: what the hardware really computes in
    emulated: ClassVar[bool] = False  # stored in the format but computed in a wider one
    compiles: ClassVar[bool] = False  # convert_module returns a torch.compile'd model: the first call compiles

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    # --- applicability -------------------------------------------------------------------------
    def supported(self, hw: HardwareInfo) -> str | None:
        """Why this policy cannot run on this hardware at all, or None when it can."""
        return None

    def availability(self, hw: HardwareInfo) -> Availability:
        why_not = self.supported(hw)
        if why_not:
            return Availability(False, why_not)
        slow = hw.slow_reason(self.compute_dtype)
        if slow:
            return Availability(True, slow, slow=True)
        return Availability(True)

    @classmethod
    def mode_error(cls, mode: str) -> str | None:
        """Why this policy cannot run in ``mode`` (train/infer), or None."""
        if mode in cls.modes:
            return None
        return f"policy {cls.name} is inference-only (it quantizes a trained model): use --mode infer"

    def require(self, hw: HardwareInfo, force: bool = False) -> None:
        """For single-policy commands (audit, trace): an error when the policy cannot run here, or when it
        was measured pathologically slow here (fp16 on a CPU without fp16 arithmetic) and not ``force``."""
        from dtypelab.core.errors import DtypelabError

        avail = self.availability(hw)
        if not avail.ok:
            raise DtypelabError(f"policy {self.name} cannot run here: {avail.reason}")
        if avail.slow and not force:
            raise DtypelabError(f"policy {self.name} is refused: {avail.reason}; --force runs it anyway")

    # --- hooks ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Set process-wide state for the run and restore it afterwards."""
        yield

    def convert_module(self, model: nn.Module) -> nn.Module:
        return model

    def convert_inputs(self, batch: Any) -> Any:
        return batch

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False when the step was skipped (e.g. inf gradients)."""
        optimizer.step()
        return True

    def stats(self) -> dict[str, Any]:
        """Policy-specific measurements to keep in the record (e.g. GradScaler history)."""
        return {}


def bf16_missing(hw: HardwareInfo, what: str) -> str | None:
    """Why bfloat16 cannot run here (pre-Ampere GPU), or None. CPUs emulate it; the probe judges speed."""
    if hw.is_cuda and hw.native("bfloat16") is False:
        return f"{what} needs compute capability >= 8.0 (this GPU is {hw.cuda_capability})"
    return None


class CastPolicy(Policy):
    """Pure low/high precision: parameters, buffers and floating inputs all cast to one dtype."""

    dtype: ClassVar[torch.dtype]

    def convert_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.dtype)

    def convert_inputs(self, batch: Any) -> Any:
        return map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, batch)


class AutocastPolicy(Policy):
    """Weights stay float32; autocast runs eligible ops in a lower precision during forward."""

    dtype: ClassVar[torch.dtype]

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype)
