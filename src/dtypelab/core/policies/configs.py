"""Precision configs: frozen, parameterised descriptions of how a module's numerics run (the torchao /
Lightning Fabric shape). A config says *what*; ``precision.Precision`` applies it to a model.

Five kinds, each a handful of fields (``Quantize`` in ``quantize.py``, ``Float8Train`` in ``float8.py``):

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

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

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
    KINDS: ClassVar[dict[str, type[Config]]] = {}  # every kind by its JSON name, filled as subclasses are defined

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            Config.KINDS[cls.kind] = cls

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
        kinds = Config.KINDS  # the package imports every kind's module (quantize, float8) before any lookup
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


def cuda_missing(hw: HardwareInfo, what: str, floor: tuple[int, int]) -> str | None:
    """Why a CUDA-only format cannot run here (the CPU, or a GPU below compute capability ``floor``), or None."""
    need = f"CUDA compute capability >= {floor[0]}.{floor[1]}"
    if not hw.is_cuda:
        return f"{what} needs {need}; this run is on the CPU"
    if hw.cuda_capability is not None and tuple(hw.cuda_capability) < floor:
        cc = ".".join(map(str, hw.cuda_capability))
        return f"{what} needs {need} (this GPU, {hw.device_name}, is {cc})"
    return None
