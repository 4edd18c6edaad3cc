"""``ExecuTorch``: inference only, the whole model exported to a ``.pte`` for ExecuTorch's XNNPACK delegate and run by
ExecuTorch's runtime on this CPU (``core.executorch``): what a phone or a board runs, measured here like any policy.

- ``et-fp32`` / ``et-fp16``: the model in float32 / float16 through XNNPACK;
- ``et-int8-dyn`` / ``et-int8``: PT2E with ExecuTorch's ``XNNPACKQuantizer`` on the linear layers, int8 weights per
  channel, activations quantized per call (dynamic) or with scales calibrated on the task's inputs (static);
- ``et-8da4w``: torchao's 8-bit dynamic activations × 4-bit weights in groups of 32, ExecuTorch's scheme for
  language models.

Needs the ``[device]`` extra (ExecuTorch 1.5, built against torchao 0.18, which the project pins); without it each
policy is skipped with the one line that installs it. The conversion's report names the operators left outside
the delegate (they run on ExecuTorch's portable kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from dtypelab.core import executorch as et
from dtypelab.core.calibration import calibration
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Facts
from dtypelab.core.policies.registry import register


@dataclass(frozen=True)
class ExecuTorch(Config):
    """Inference only, the whole model: a ``.pte`` run by ExecuTorch's runtime through XNNPACK."""

    kind: ClassVar[str] = "executorch"
    scheme: str = "fp32"

    def __post_init__(self) -> None:
        if self.scheme not in et.SCHEMES:
            raise DtypelabError(f"executorch: unknown scheme {self.scheme!r}; use one of {', '.join(et.SCHEMES)}")

    @property
    def facts(self) -> Facts:
        # the probe times torch's kernels, not XNNPACK's: it cannot say in advance that these are slow here, so
        # each is judged by its own timing (the sweep's slow watch still stops a run 10x slower than fp32)
        return Facts(modes=("infer",), compute_dtype="float16" if self.scheme == "fp16" else "float32",
                     probe="float32", backend=f"executorch {et.VERSION} (XNNPACK delegate)", program="ExecuTorch",
                     arithmetic=et.SCHEMES[self.scheme])

    @property
    def label(self) -> str:
        return f"et-{self.scheme}"

    def describe(self) -> str:
        return f"ExecuTorch .pte through XNNPACK: {et.SCHEMES[self.scheme]}; run by ExecuTorch's runtime"

    def supported(self, hw: HardwareInfo) -> str | None:
        if hw.is_cuda:
            return "ExecuTorch's XNNPACK delegate runs on CPUs (a phone's, a board's, this one's): use --device cpu"
        return et.missing()

    def plan_error(self, plan: Any) -> str | None:
        if plan.default != self or plan.rules:
            return f"{self.label} exports the whole model to one .pte: use it alone, as the plan's default"
        return None

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        """The whole model exported at the calibration feed's first call (bench and export give the task's inputs),
        lowered and loaded by ExecuTorch's runtime."""
        calls = et.example_calls(model, calibration())
        lowered = et.lower(model.float().eval(), self.scheme, calls)
        report = {"format": "ExecuTorch .pte", "delegate": "XNNPACK", "delegated": lowered.delegated,
                  "fallback": dict(lowered.fallback), "planned_bytes": lowered.planned_bytes}
        return et.PteModule(lowered), report


for _rank, _scheme in enumerate(et.SCHEMES):
    register(f"et-{_scheme}", ExecuTorch(_scheme), sweeps=frozenset(), rank=40 + _rank / 10)

__all__ = ["ExecuTorch"]
