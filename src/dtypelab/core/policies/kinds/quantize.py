"""``Quantize``: inference only, every ``nn.Linear`` it covers becomes an int8, fp8 or int4 layer (torchao's configs,
or the deprecated ``torch.ao.quantization``)."""

from __future__ import annotations

import contextlib
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, Facts, cuda_missing
from dtypelab.core.policies.kinds.cast import Cast
from dtypelab.core.policies.kinds.float8 import float8_unfit
from dtypelab.core.policies.registry import in_default, register

# scheme -> (what it stores and computes, compute dtype for the probe, emulated)
SCHEMES = {
    "int8-dynamic": ("int8 × int8 matmul, activations quantized per token at run time", "int8", False),
    "int8-weight-only": ("float matmul on int8 weights scaled per channel (weight-only: activations stay "
                         "float)", "float32", False),
    "fp8-weight-only": ("emulated: fp8 e4m3 weights dequantized to float32 for every matmul", "float32", True),
    "fp8-dynamic": ("float8 e4m3 × e4m3 tensor-core matmul (torch._scaled_mm), activations quantized at run time, "
                    "bfloat16 out", "float8_e4m3fn", False),
    "int4-weight-only": ("bfloat16 activations × int4 weights in groups of 128 (tinygemm's "
                         "torch._weight_int4pack_mm)", "bfloat16", False),
}
# GPU-only schemes: bfloat16 models (their kernels take bfloat16 activations), a CUDA compute capability floor.
GPU_SCHEMES = {"fp8-dynamic": ((8, 9), "float8 tensor-core matmuls (torch._scaled_mm)"),
               "int4-weight-only": ((8, 0), "tinygemm's int4 CUDA kernel (torch._weight_int4pack_mm)")}
INT4_GROUP = 128  # torchao's default group size; a layer whose input width it does not divide stays unquantized
BACKENDS = ("torchao", "torch.ao")
GRANULARITIES = ("per-channel", "per-tensor")


@dataclass(frozen=True)
class Quantize(Config):
    """Inference only: every ``nn.Linear`` it covers becomes an int8 / fp8 layer.

    ``backend`` torchao (``quantize_`` with its frozen configs; weights per output channel, activations
    per token) or torch.ao (the deprecated ``quantize_dynamic``: int8-dynamic only, CPU only, activations
    per tensor, weights ``granularity``). ``compile``: run the model under ``torch.compile`` (inductor
    fuses the quantize and rescale steps; the first call compiles).
    """

    kind: ClassVar[str] = "quantize"
    scheme: str = "int8-dynamic"
    library: str = "torchao"
    granularity: str = "per-channel"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise DtypelabError(f"quantize: unknown scheme {self.scheme!r}; use one of {', '.join(SCHEMES)}")
        if self.library not in BACKENDS:
            raise DtypelabError(f"quantize: unknown backend {self.library!r}; use torchao or torch.ao")
        if self.granularity not in GRANULARITIES:
            raise DtypelabError(f"quantize: granularity must be per-channel or per-tensor, not {self.granularity!r}")
        if self.library == "torch.ao" and (self.scheme != "int8-dynamic" or self.compile):
            raise DtypelabError("quantize: the torch.ao backend offers int8-dynamic only, without compile")
        if self.library == "torchao" and self.granularity != "per-channel" and self.scheme != "fp8-dynamic":
            raise DtypelabError("quantize: torchao's configs here are per-channel (weights) / per-token; "
                                "per-tensor is for fp8-dynamic and the torch.ao backend")

    @property
    def facts(self) -> Facts:
        return Facts(modes=("infer",), compute_dtype=SCHEMES[self.scheme][1], storage_dtype="bfloat16" if self.scheme
                     in GPU_SCHEMES else "float32", gpu_only=self.scheme in GPU_SCHEMES, probe=self._probe(),
                     backend="torchao" if self.library == "torchao" else "torch.ao.quantization (deprecated)",
                     arithmetic=self._arithmetic(), emulated=SCHEMES[self.scheme][2], compiles=self.compile)

    def _probe(self) -> str:
        if self.scheme == "fp8-dynamic":
            return "fp8"  # the probe's torch._scaled_mm
        if self.library == "torch.ao":
            return "int8-fbgemm"
        if self.scheme == "int8-dynamic":
            # compiled too: inductor fuses the quantize/dequantize around it but keeps an int8 x int8 matmul,
            # which is slow where torch._int_mm is (on an AVX2-only EPYC without VNNI: 19x slower than fp32 on
            # minilm, 0.45x on digits), so the probe's int8 verdict holds for both
            return "int8"
        return self.scheme

    def _arithmetic(self) -> str:
        if self.library == "torch.ao":
            if self.granularity == "per-channel":
                return "int8 × int8 matmul (fbgemm/x86), per-channel weights, per-tensor activations"
            return "int8 × int8 matmul (fbgemm/x86), activations quantized per tensor at run time"
        return SCHEMES[self.scheme][0]

    @property
    def label(self) -> str:
        short = {"int8-dynamic": "int8-dyn", "int8-weight-only": "int8-wo", "fp8-weight-only": "fp8-wo",
                 "fp8-dynamic": "fp8-dyn", "int4-weight-only": "int4-wo"}[self.scheme]
        if self.scheme == "fp8-dynamic":
            short += "-row" if self.granularity == "per-channel" else "-tensor"
        if self.library == "torch.ao":
            return short + "-legacy" + ("-pc" if self.granularity == "per-channel" else "")
        return short + ("-compile" if self.compile else "")

    def describe(self) -> str:
        what = {"int8-dynamic": "int8 weights (per channel) + int8 activations (per token)",
                "int8-weight-only": "int8 weights (per channel), float activations",
                "fp8-weight-only": "fp8 e4m3 weights (per channel), float activations",
                "fp8-dynamic": "fp8 e4m3 weights + fp8 activations (" + (
                    "per row: weights per output channel, activations per token" if self.granularity == "per-channel"
                    else "one scale per tensor") + "), bfloat16 elsewhere",
                "int4-weight-only": f"int4 weights (groups of {INT4_GROUP}), bfloat16 activations"}[self.scheme]
        if self.library == "torch.ao":
            scales = "one weight scale per output channel" if self.granularity == "per-channel" else (
                "one scale per tensor")
            return f"int8 weights + activations, {scales}, torch.ao.quantization (deprecated), CPU"
        tail = " under torch.compile (inductor fuses the quantize/scale steps); first call compiles" if self.compile \
            else (", torchao (emulated: fp8 storage only)" if SCHEMES[self.scheme][2] else ", torchao")
        return what + tail

    def supported(self, hw: HardwareInfo) -> str | None:
        if self.library == "torch.ao":
            if hw.is_cuda:
                return "torch.ao dynamic quantization runs on the CPU only (fbgemm/x86 kernels)"
            engines = [e for e in torch.backends.quantized.supported_engines if e in ("x86", "fbgemm", "qnnpack")]
            return None if engines else "this torch build has no quantized CPU engine (x86, fbgemm or qnnpack)"
        missing = torchao_missing()
        if missing:
            return missing
        if self.scheme in GPU_SCHEMES:
            floor, what = GPU_SCHEMES[self.scheme]
            return cuda_missing(hw, f"{self.label} runs {what}: it", floor)
        if self.compile and not hw.is_cuda and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "torch.compile on the CPU needs a C++ compiler (g++ or clang++), none found"
        return None

    def plan_error(self, plan: Any) -> str | None:
        rule = next((p for p, c in plan.rules if c == self), None)
        if self.library == "torch.ao" and rule is not None and plan.default != Cast("float32"):
            return f"torch.ao quantization needs float32 layers; the default is {plan.default.label} (rule {rule!r})"
        if rule is not None and self.compile != plan.compiles:
            return "compile applies to the whole model; give every quantize config the same compile setting"
        if plan.default == self and any(c.facts.autocast_dtype for c in plan.configs):
            return "autocast rules need an unquantized default"
        return None

    def torchao_config(self) -> Any:
        """The torchao config object (``set_inductor_config=False``: dtypelab patches inductor per run, never
        process-wide)."""
        q = torchao_module("quantization")
        if self.scheme == "int8-dynamic":
            return q.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
        if self.scheme == "int8-weight-only":
            return q.Int8WeightOnlyConfig(set_inductor_config=False)
        if self.scheme == "fp8-dynamic":
            granularity = q.PerRow() if self.granularity == "per-channel" else q.PerTensor()
            return q.Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False)
        if self.scheme == "int4-weight-only":  # tinygemm's layout: the int4 kernel torch itself ships for CUDA
            return q.Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                          set_inductor_config=False)
        return q.Float8WeightOnlyConfig(weight_dtype=torch.float8_e4m3fn, set_inductor_config=False)

    # --- hooks ---------------------------------------------------------------------------------------
    def session(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if not self.compile:
            return contextlib.nullcontext()
        # torchao's recommended inductor settings, patched for the run only (its configs would set them
        # process-wide; every config here passes set_inductor_config=False).
        from torch._inductor import config

        stack = contextlib.ExitStack()
        stack.enter_context(config.patch(coordinate_descent_tuning=True, force_fuse_int_mm_with_mul=True))
        stack.enter_context(quiet())
        return stack

    def region(self, parent: Config, outer: torch.dtype) -> Config | None:
        stored = self.facts.storage_dtype
        if stored != "float32" and getattr(torch, stored) != outer:
            return Cast(stored)  # its kernel takes bfloat16 activations: the layer in bfloat16
        return None

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        """Exactly the linear layers called ``names`` quantized; a GPU format's layers its kernel cannot take are
        left out, and the report says so."""
        modules = dict(model.named_modules())
        names = [n for n in names if isinstance(modules[n], nn.Linear)]
        report: dict[str, Any] = {}
        if self.facts.gpu_only:
            unfit = {n: why for n in names if (why := self.unfit(modules[n]))}
            names = [n for n in names if n not in unfit]
            report = {"format": self.label, "converted": list(names),
                      "left_out": [{"layer": n, "why": why} for n, why in unfit.items()]}
        if not names:
            return model, report
        if self.library == "torchao":
            chosen = set(names)
            with quiet():
                torchao_module("quantization").quantize_(model, self.torchao_config(),
                                                         filter_fn=lambda m, fqn: fqn in chosen)
            return model, report
        with warnings.catch_warnings():
            # its deprecation notices (and torch.jit's, from its packed modules): the policy's summary says so
            warnings.simplefilter("ignore")
            from torch.ao import quantization as tq

            qconfig = tq.per_channel_dynamic_qconfig if self.granularity == "per-channel" else \
                tq.default_dynamic_qconfig
            return tq.quantize_dynamic(model, dict.fromkeys(names, qconfig), dtype=torch.qint8), report

    # --- what it stores, and runs on a GPU: the answers the forecasts' adapters read (a new scheme says its own) ---
    def stored_bytes(self, layer: nn.Module) -> int | None:
        """The converted layer's weight by torchao's layouts (``Int4TilePackedTo4dTensor``: int4 codes packed in
        int32, the input width padded to 1024 and the outputs to 8, bfloat16 scale and zero point per group of 128;
        ``Float8Tensor``: e4m3 codes and a float32 scale per row or per tensor) and fbgemm's packed int8 weight (int8
        codes, a float32 scale and an int32 zero point per output channel or per tensor); None: the layer stays as it
        is, or the format converts anywhere (its tensors are traced)."""
        if not isinstance(layer, nn.Linear) or (self.facts.gpu_only and self.unfit(layer)):
            return None
        n, k = layer.out_features, layer.in_features
        if self.scheme == "int4-weight-only":
            n_pad, k_pad = -(-n // 8) * 8, -(-k // 1024) * 1024
            return n_pad * k_pad // 2 + (k_pad // INT4_GROUP) * n_pad * 2 * 2
        per_channel = self.granularity == "per-channel"
        if self.scheme == "fp8-dynamic":
            return n * k + (4 * n if per_channel else 4)
        if self.library == "torch.ao":
            return n * k + (8 * n if per_channel else 8)
        return None  # torchao's CPU formats convert anywhere: traced

    def kernel(self, layer: nn.Module) -> str | None:
        """The GPU kernel a layer it converts runs (serving's ``KERNELS`` key): the scheme, fp8's by granularity;
        None for a layer it leaves as it is (int4 needs whole groups of 128 inputs)."""
        if not isinstance(layer, nn.Linear) or self.unfit(layer):
            return None
        return f"{self.scheme}-{self.granularity}" if self.scheme == "fp8-dynamic" else self.scheme

    def unfit(self, layer: nn.Linear) -> str | None:
        """Why a GPU format's kernel cannot take this layer (torchao would leave it as it is, silently), or None."""
        n, k = layer.out_features, layer.in_features
        if self.scheme == "int4-weight-only" and (k % INT4_GROUP or n % 8):  # tinygemm: whole groups, tiles of 8
            return f"{n}×{k}: int4 needs the input width a multiple of {INT4_GROUP} (its group size) and the outputs " \
                "of 8"
        return float8_unfit(n, k) if self.scheme == "fp8-dynamic" else None


register("int8-dyn", Quantize("int8-dynamic"), "int8 weights (per channel) + int8 activations (per token), torchao, "
         "eager", rank=8)
register("int8-dyn-compile", Quantize("int8-dynamic", compile=True), rank=12)
register("int8-wo", Quantize("int8-weight-only"), rank=13)
register("fp8-wo", Quantize("fp8-weight-only"), rank=14)
register("int8-dyn-legacy", Quantize("int8-dynamic", library="torch.ao", granularity="per-tensor"), rank=15)
register("int8-dyn-legacy-pc", Quantize("int8-dynamic", library="torch.ao", granularity="per-channel"), rank=16)
# GPU-native formats (CUDA only; a CPU sweep leaves them out unless named): real float8 inference matmuls on compute
# capability >= 8.9, int4 weight-only inference
register("fp8-dyn-row", Quantize("fp8-dynamic"), rank=20)
register("fp8-dyn-tensor", Quantize("fp8-dynamic", granularity="per-tensor"), rank=21)
register("int4-wo", Quantize("int4-weight-only"), rank=22)
for _listing, _entries in (("forecast-train", (("int8-wo", 7), ("fp8-dyn-row", 8), ("int4-wo", 9))),
                           ("forecast-infer", (("int8-dyn", 3), ("int8-wo", 4), ("fp8-wo", 5), ("fp8-dyn-row", 6),
                                               ("int4-wo", 7))),
                           ("serve-measured", (("int8-wo", 3), ("int8-dyn", 4), ("fp8-wo", 5))),
                           ("serve-forecast", (("int8-wo", 2), ("fp8-dyn-row", 3), ("int4-wo", 4))),
                           ("serve-forecast-cpu", (("int8-wo", 3),))):
    for _name, _rank in _entries:
        in_default(_listing, _name, _rank)
