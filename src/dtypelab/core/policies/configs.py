"""Precision configs: frozen, parameterised descriptions of how a module's numerics run (the torchao /
Lightning Fabric shape). A config says *what*; ``precision.Precision`` applies it to a model.

Five kinds, each a handful of fields:

- ``Cast(dtype)``: weights, buffers, activations, gradients and optimizer state in one float dtype
  (``Cast("float32")`` is the baseline).
- ``TF32()``: float32 tensors, TF32 tensor-core matmuls and convolutions (a process-wide CUDA flag).
- ``Autocast(dtype, scaler)``: float32 weights, ``torch.autocast`` to ``dtype`` in the forward pass,
  optionally with a GradScaler (float16's narrow range needs one).
- ``Quantize(scheme, backend, granularity, compile)``: inference only; the model's ``nn.Linear``
  layers become int8 / fp8 / int4 ones (torchao, or the deprecated ``torch.ao.quantization``).
- ``Float8Train(recipe)``: training only, CUDA only: the ``nn.Linear`` layers large enough to pay run float8
  matmuls (torchao's ``convert_to_float8_training``), the rest of the model under bfloat16 autocast, compiled.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch

from dtypelab.core.backends import torchao_missing, torchao_module
from dtypelab.core.errors import DtypelabError
from dtypelab.core.hardware import HardwareInfo

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
T = TypeVar("T")
SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _float_dtype(name: str, what: str) -> str:
    canonical = {v: k for k, v in SHORT.items()}.get(name, name)
    if canonical not in FLOAT_DTYPES:
        raise DtypelabError(f"{what}: unknown dtype {name!r}; use one of {', '.join(FLOAT_DTYPES)}")
    return canonical


def bf16_missing(hw: HardwareInfo, what: str) -> str | None:
    """Why bfloat16 cannot run here (pre-Ampere GPU), or None. CPUs emulate it; the probe judges speed."""
    if hw.is_cuda and hw.native("bfloat16") is False:
        return f"{what} needs compute capability >= 8.0 (this GPU is {hw.cuda_capability})"
    return None


@dataclass(frozen=True)
class Config:
    """One way to run a module's numerics. Subclasses are frozen dataclasses; ``kind`` names them in JSON."""

    kind: ClassVar[str]
    modes: ClassVar[tuple[str, ...]] = ("train", "infer")
    # Defaults that kinds override (with a property where the value depends on the fields):
    compute_dtype: ClassVar[str] = "float32"  # what the matmuls run in: the hardware probe's throughput key
    backend: ClassVar[str] = "torch"
    arithmetic: ClassVar[str] = ""  # for formats that need saying: what the hardware really computes in
    emulated: ClassVar[bool] = False  # stored in the format, computed in a wider one: its speed is not its own
    compiles: ClassVar[bool] = False
    storage_dtype: ClassVar[str] = "float32"  # what the model's floats (and its inputs) are cast to
    autocast_dtype: ClassVar[str | None] = None  # the forward's autocast dtype, when the config runs one
    # a GPU format with no CPU path at all: a CPU run's default sweep leaves it out (tf32 stays in: it is the
    # first question on a GPU, and its one skipped row says where it runs)
    gpu_only: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """A short name for a config that is not registered under one."""
        return self.kind

    @property
    def probe_key(self) -> str:
        """The hardware probe's throughput entry that decides whether this config is pathologically slow here:
        its compute dtype, or the kernel a quantized config runs."""
        return self.compute_dtype

    def describe(self) -> str:
        raise NotImplementedError

    def supported(self, hw: HardwareInfo) -> str | None:
        """Why this config cannot run on this hardware at all, or None when it can."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Config:
        kinds = {k.kind: k for k in (Cast, TF32, Autocast, Quantize, Float8Train)}
        d = dict(d)
        kind = kinds.get(d.pop("kind", None))
        if kind is None:
            raise DtypelabError(f"unknown config kind in {d!r}: use one of {', '.join(kinds)}")
        return from_fields(kind, d, f"{kind.kind} config")


def from_fields(cls: type[T], d: dict[str, Any], what: str) -> T:
    """``cls(**d)``, with a one-line error naming any field ``cls`` does not have."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise DtypelabError(f"{what}: unknown field(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(sorted(known)) or 'none'}")
    return cls(**d)


@dataclass(frozen=True)
class Cast(Config):
    """Pure precision: the module's parameters, buffers and floating inputs all in ``dtype``."""

    kind: ClassVar[str] = "cast"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _float_dtype(self.dtype, "cast"))

    @property
    def compute_dtype(self) -> str:
        return self.dtype

    @property
    def storage_dtype(self) -> str:
        return self.dtype

    @property
    def label(self) -> str:
        return SHORT[self.dtype]

    def describe(self) -> str:
        if self.dtype == "float32":
            return "float32 everywhere (baseline)"
        scaling = ", no loss scaling" if self.dtype == "float16" else ""
        return f"{self.dtype} weights, activations, gradients and optimizer state{scaling}"

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16") if self.dtype == "bfloat16" else None


@dataclass(frozen=True)
class TF32(Config):
    """float32 storage, matmuls and convolutions on tensor cores with a 10-bit mantissa (CUDA only)."""

    kind: ClassVar[str] = "tf32"
    compute_dtype: ClassVar[str] = "tf32"
    label: ClassVar[str] = "tf32"

    def describe(self) -> str:
        return "float32 tensors, TF32 tensor-core matmuls and convolutions"

    def supported(self, hw: HardwareInfo) -> str | None:
        if not hw.is_cuda:
            return "tf32 is a CUDA tensor-core mode (Ampere or newer); this run is on the CPU"
        if hw.native("tf32") is False:
            return f"tf32 needs compute capability >= 8.0 (this GPU is {hw.cuda_capability})"
        return None


@dataclass(frozen=True)
class Autocast(Config):
    """float32 weights; eligible forward ops run in ``dtype`` under ``torch.autocast``; ``scaler`` adds a
    GradScaler (scale per step, skipped steps and their non-finite parameters are recorded)."""

    kind: ClassVar[str] = "autocast"
    dtype: str = "bfloat16"
    scaler: bool = False

    def __post_init__(self) -> None:
        dtype = _float_dtype(self.dtype, "autocast")
        if dtype not in ("bfloat16", "float16"):
            raise DtypelabError(f"autocast: dtype must be bfloat16 or float16, not {dtype}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def compute_dtype(self) -> str:
        return self.dtype

    @property
    def autocast_dtype(self) -> str:
        return self.dtype

    @property
    def label(self) -> str:
        return f"amp-{SHORT[self.dtype]}" + ("" if self.scaler == (self.dtype == "float16") else
                                             ("+scaler" if self.scaler else "-noscaler"))

    def describe(self) -> str:
        return f"torch.autocast({self.dtype}){' + GradScaler' if self.scaler else ''}, float32 weights"

    def supported(self, hw: HardwareInfo) -> str | None:
        return bf16_missing(hw, "bfloat16 autocast") if self.dtype == "bfloat16" else None


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


def cuda_missing(hw: HardwareInfo, what: str, floor: tuple[int, int]) -> str | None:
    """Why a CUDA-only format cannot run here (the CPU, or a GPU below compute capability ``floor``), or None."""
    need = f"CUDA compute capability >= {floor[0]}.{floor[1]}"
    if not hw.is_cuda:
        return f"{what} needs {need}; this run is on the CPU"
    if hw.cuda_capability is not None and tuple(hw.cuda_capability) < floor:
        cc = ".".join(map(str, hw.cuda_capability))
        return f"{what} needs {need} (this GPU, {hw.device_name}, is {cc})"
    return None


@dataclass(frozen=True)
class Quantize(Config):
    """Inference only: every ``nn.Linear`` it covers becomes an int8 / fp8 layer.

    ``backend`` torchao (``quantize_`` with its frozen configs; weights per output channel, activations
    per token) or torch.ao (the deprecated ``quantize_dynamic``: int8-dynamic only, CPU only, activations
    per tensor, weights ``granularity``). ``compile``: run the model under ``torch.compile`` (inductor
    fuses the quantize and rescale steps; the first call compiles).
    """

    kind: ClassVar[str] = "quantize"
    modes: ClassVar[tuple[str, ...]] = ("infer",)
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
    def compute_dtype(self) -> str:
        return SCHEMES[self.scheme][1]

    @property
    def storage_dtype(self) -> str:
        return "bfloat16" if self.scheme in GPU_SCHEMES else "float32"

    @property
    def gpu_only(self) -> bool:
        return self.scheme in GPU_SCHEMES

    @property
    def probe_key(self) -> str:
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

    @property
    def backend(self) -> str:
        return "torchao" if self.library == "torchao" else "torch.ao.quantization (deprecated)"

    @property
    def arithmetic(self) -> str:
        if self.library == "torch.ao":
            if self.granularity == "per-channel":
                return "int8 × int8 matmul (fbgemm/x86), per-channel weights, per-tensor activations"
            return "int8 × int8 matmul (fbgemm/x86), activations quantized per tensor at run time"
        return SCHEMES[self.scheme][0]

    @property
    def emulated(self) -> bool:
        return SCHEMES[self.scheme][2]

    @property
    def compiles(self) -> bool:
        return self.compile

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
            else (", torchao (emulated: fp8 storage only)" if self.emulated else ", torchao")
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


FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_FLOOR = (8, 9)  # Ada and Hopper: float8 tensor cores


@dataclass(frozen=True)
class Float8Train(Config):
    """Training on float8 tensor cores (torchao's ``convert_to_float8_training``): each ``nn.Linear`` large enough
    to pay runs its three matmuls (forward, input and weight gradients) in float8 with scales per tensor
    (``tensorwise``) or per row (``rowwise``); every other op runs under bfloat16 autocast; the model is compiled,
    which torchao needs to fuse the casts. ``min_size``: "auto" leaves out layers whose shapes torchao measured
    slower in float8 on an H100 (casting costs more than the matmul saves), "none" converts every layer whose
    dimensions are multiples of 16 (the hardware's requirement)."""

    kind: ClassVar[str] = "float8-train"
    modes: ClassVar[tuple[str, ...]] = ("train",)
    compute_dtype: ClassVar[str] = "float8_e4m3fn"
    backend: ClassVar[str] = "torchao"
    compiles: ClassVar[bool] = True
    autocast_dtype: ClassVar[str] = "bfloat16"
    gpu_only: ClassVar[bool] = True
    recipe: str = "tensorwise"
    min_size: str = "auto"

    def __post_init__(self) -> None:
        if self.recipe not in FLOAT8_RECIPES:
            raise DtypelabError(f"float8-train: unknown recipe {self.recipe!r}; use one of {', '.join(FLOAT8_RECIPES)}")
        if self.min_size not in ("auto", "none"):
            raise DtypelabError(f"float8-train: min_size must be auto or none, not {self.min_size!r}")

    @property
    def probe_key(self) -> str:
        return "fp8"

    @property
    def label(self) -> str:
        return f"fp8-{self.recipe}" + ("-all" if self.min_size == "none" else "")

    @property
    def arithmetic(self) -> str:
        scales = "one scale per tensor" if self.recipe == "tensorwise" else "scales per row"
        return (f"float8 tensor-core matmuls (e4m3, {scales}) in the converted Linear layers, bfloat16 autocast "
                "elsewhere")

    def describe(self) -> str:
        which = "large enough to pay" if self.min_size == "auto" else "with dimensions divisible by 16"
        return (f"float8 training ({self.recipe} scales, torchao) in the Linear layers {which}, bfloat16 autocast "
                "elsewhere, under torch.compile")

    def supported(self, hw: HardwareInfo) -> str | None:
        return torchao_missing() or cuda_missing(hw, "float8 training runs float8 tensor-core matmuls: it",
                                                 FLOAT8_FLOOR)

    def left_out(self, out_features: int, in_features: int) -> str | None:
        """Why a Linear layer of this shape stays out of float8, or None to convert it. The size thresholds are
        torchao's own (``_auto_filter_for_recipe``), from its float8 microbenchmarks on an H100."""
        n, k = out_features, in_features
        if n % 16 or k % 16:
            return f"{n}×{k}: float8 matmuls need dimensions divisible by 16"
        if self.min_size == "none":
            return None
        if self.recipe == "tensorwise" and k <= 4096 and n <= 1024:
            return f"{n}×{k}: too small to pay (tensorwise gains need out > 1024 or in > 4096)"
        if self.recipe == "rowwise" and (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)):
            return f"{n}×{k}: too small to pay (rowwise gains need out > 2048 and in > 1024, and more than 4096×2048)"
        return None
