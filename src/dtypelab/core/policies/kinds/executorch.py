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
from dtypelab.core import executorch_lm as et_lm
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

    @property
    def calibrated(self) -> bool:
        """Its activations' scales are calibrated on the task's inputs (a language model's: calibration text)."""
        return self.scheme == "int8"

    def plan_error(self, plan: Any) -> str | None:
        if plan.default != self or plan.rules:
            return f"{self.label} exports the whole model to one .pte: use it alone, as the plan's default"
        return None

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        """A language model: a generation program with its cache inside, of the shape serving asks for
        (``et_lm.generating``) or of the task's calls. Any other model: exported whole at the calibration feed's
        first call (bench and export give the task's inputs). Either lowered and loaded by ExecuTorch's runtime."""
        shape, feed = et_lm.generation(), calibration()
        if shape is None and et_lm.generates(model):  # a language model is a generation program on the device
            shape = et_lm.shape_of(et.example_calls(model, feed))
        if shape is not None:
            lowered = et_lm.lower_lm(model.float(), self.scheme, shape, feed)
        else:
            lowered = et.lower(model.float().eval(), self.scheme, et.example_calls(model, feed))
        module = et_lm.program_module(lowered)
        report = {"format": "ExecuTorch .pte", "delegate": "XNNPACK", "delegated": lowered.delegated,
                  "fallback": dict(lowered.fallback), "planned_bytes": lowered.planned_bytes}
        if lowered.max_len:
            report.update(batch=lowered.batch, max_len=lowered.max_len, cache_bytes=lowered.cache_bytes)
        return module, report


for _rank, _scheme in enumerate(et.SCHEMES):
    register(f"et-{_scheme}", ExecuTorch(_scheme), sweeps=frozenset(), rank=40 + _rank / 10)

__all__ = ["ExecuTorch"]
