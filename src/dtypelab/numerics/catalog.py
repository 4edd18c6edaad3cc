"""Numeric formats: every property computed from torch / numpy / ml_dtypes, and a cast into each.

A format is "torch" when PyTorch can store it (then casts are PyTorch's own, quirks included), "ml_dtypes"
when only ml_dtypes can (fp4, fp6, int4), or "tf32": a compute mode that rounds float32 inputs of a
matmul to 10 mantissa bits, emulated here by rounding to nearest even.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from functools import cache

import ml_dtypes
import numpy as np
import torch

from dtypelab.core.errors import DtypelabError

# (name, backend, note). Order: the order tables show them in.
_SPECS: tuple[tuple[str, str, str], ...] = (
    ("float64", "torch", ""),
    ("float32", "torch", ""),
    ("tf32", "tf32", "compute mode of NVIDIA tensor cores (Ampere+), not a storage type"),
    ("bfloat16", "torch", ""),
    ("float16", "torch", ""),
    ("float8_e4m3fn", "torch", "no inf; PyTorch saturates overflow to ±max"),
    ("float8_e5m2", "torch", ""),
    ("float8_e4m3fnuz", "torch", "AMD MI300 variant: no inf, no -0, overflow becomes NaN"),
    ("float8_e5m2fnuz", "torch", "AMD MI300 variant: no inf, no -0, overflow becomes NaN"),
    ("float8_e8m0fnu", "torch", "MX block scale: powers of two only, no zero, no sign"),
    ("float6_e3m2fn", "ml_dtypes", "MX element format; no inf or NaN, saturates"),
    ("float6_e2m3fn", "ml_dtypes", "MX element format; no inf or NaN, saturates"),
    ("float4_e2m1fn", "ml_dtypes", "MX/NVFP4 element format; no inf or NaN, saturates"),
    ("int64", "torch", ""),
    ("int32", "torch", ""),
    ("int16", "torch", ""),
    ("int8", "torch", ""),
    ("uint8", "torch", ""),
    ("int4", "ml_dtypes", "stored one per byte by ml_dtypes; packed two per byte in practice"),
    ("uint4", "ml_dtypes", "stored one per byte by ml_dtypes; packed two per byte in practice"),
)

ALIASES = {
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "e8m0": "float8_e8m0fnu",
    "fp6_e3m2": "float6_e3m2fn", "fp6_e2m3": "float6_e2m3fn",
    "fp4": "float4_e2m1fn", "e2m1": "float4_e2m1fn", "nvfp4": "float4_e2m1fn", "mxfp4": "float4_e2m1fn",
    "long": "int64", "int": "int32", "short": "int16", "i8": "int8", "u8": "uint8",
}

# Formats the range audit scores by default: the ones people train or serve in.


@dataclass(frozen=True)
class Format:
    name: str
    backend: str  # "torch", "ml_dtypes" or "tf32"
    kind: str  # "float" or "int"
    bits: int
    exponent_bits: int
    mantissa_bits: int  # explicit (stored) fraction bits
    max: float  # largest finite value
    min: float  # most negative finite value
    smallest_normal: float | None
    smallest_subnormal: float | None  # None: the format has no subnormals
    eps: float  # gap between 1 and the next value (1 for integers)
    has_inf: bool
    has_nan: bool
    note: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: log10 of 2^(mantissa bits + 1); for integers, digits of max."""
        if self.is_float:
            return (self.mantissa_bits + 1) * math.log10(2)
        return math.log10(self.max + 1)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.name) if self.backend == "torch" else None

    @property
    def storage_bits(self) -> int:
        """Bits per element in memory as PyTorch or ml_dtypes hold it (tf32 lives in float32)."""
        return 32 if self.backend == "tf32" else 8 * self.numpy_dtype.itemsize

    @property
    def numpy_dtype(self) -> np.dtype:
        if self.backend == "tf32":
            return np.dtype(np.float32)
        return np.dtype(getattr(ml_dtypes, self.name, None) or getattr(np, self.name))


def ieee_like(nexp: int, nmant: int) -> dict[str, float]:
    """Range of an IEEE-754-style binary format with all-ones exponent reserved for inf/NaN."""
    bias = 2 ** (nexp - 1) - 1
    return {"max": (2 - 2.0**-nmant) * 2.0**bias, "smallest_normal": 2.0 ** (1 - bias),
            "smallest_subnormal": 2.0 ** (1 - bias - nmant), "eps": 2.0**-nmant}


def _build(name: str, backend: str, note: str) -> Format:
    aliases = tuple(sorted(a for a, n in ALIASES.items() if n == name))
    if backend == "tf32":  # float32's exponent, float16's mantissa
        r = ieee_like(8, 10)
        return Format(name, backend, "float", 19, 8, 10, r["max"], -r["max"], r["smallest_normal"],
                      r["smallest_subnormal"], r["eps"], True, True, note, aliases)
    dt = getattr(ml_dtypes, name, None) or getattr(np, name)
    if np.issubdtype(np.dtype(dt), np.integer) or name in ("int4", "uint4"):
        ii = ml_dtypes.iinfo(dt)
        return Format(name, backend, "int", int(ii.bits), 0, 0, float(ii.max), float(ii.min), None, None,
                      1.0, False, False, note, aliases)
    fi = ml_dtypes.finfo(dt)
    nexp, nmant, bits = int(fi.nexp), int(fi.nmant), int(fi.bits)
    sub = float(fi.smallest_subnormal)
    normal = float(fi.smallest_normal)
    has_nan = bool(np.isnan(np.array([np.nan]).astype(dt).astype(np.float64))[0])
    has_inf = bool(np.isinf(np.array([np.inf]).astype(dt).astype(np.float64))[0])
    signed = float(np.array([-1.0]).astype(dt).astype(np.float64)[0]) == -1.0
    return Format(
        name, backend, "float", bits, nexp, nmant, float(fi.max), float(fi.min) if signed else 0.0,
        normal, sub if sub < normal else None, float(fi.eps),
        has_inf, has_nan, note, aliases)


@cache
def formats() -> dict[str, Format]:
    """Every known format by canonical name, in table order."""
    return {name: _build(name, backend, note) for name, backend, note in _SPECS}


def get_format(name: str) -> Format:
    """Look a format up by name, alias or ``torch.<dtype>`` spelling; unknown names get a suggestion."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    table = formats()
    if key in table:
        return table[key]
    names = list(table) + list(ALIASES)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {ALIASES.get(close[0], close[0])!r}?" if close else ""
    raise DtypelabError(f"unknown format {name!r}{hint} (see: dtypelab formats)")


def parse_formats(spec: str | list[str] | tuple[str, ...]) -> tuple[Format, ...]:
    names = spec.split(",") if isinstance(spec, str) else spec
    out = tuple(get_format(n) for n in names if str(n).strip())
    if not out:
        raise DtypelabError("no formats given")
    return out


# --- casting --------------------------------------------------------------------------------------
def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to 10 mantissa bits, ties to even; NaN and inf pass through."""
    x = x.to(torch.float32).contiguous()
    bits = x.view(torch.int32)
    rounded = ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def cast(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert x to fmt the way its backend does; return (stored values as float64, raw bits as int64).

    Raw bits are the format's own encoding, right-aligned (sign | exponent | mantissa for floats,
    two's complement for signed integers).
    """
    x = x.detach().cpu()
    if fmt.backend == "torch":
        y = x.to(fmt.torch_dtype)
        raw = y.view({8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[fmt.storage_bits])
        raw = raw.to(torch.int64)
        values = y.to(torch.float64)
    elif fmt.backend == "tf32":
        y = _round_tf32(x)
        raw = (y.view(torch.int32).to(torch.int64) >> 13)
        values = y.to(torch.float64)
    else:
        arr = x.to(torch.float64).numpy().astype(fmt.numpy_dtype)
        raw = torch.from_numpy(arr.view(np.uint8).astype(np.int64))
        values = torch.from_numpy(arr.astype(np.float64))
    return values, raw & ((1 << fmt.bits) - 1)


def bit_fields(raw: int, fmt: Format) -> str:
    """'s | eeeee | mmmmmmmmmm' for floats, the bits in groups of four for integers."""
    text = format(raw & ((1 << fmt.bits) - 1), f"0{fmt.bits}b")
    if not fmt.is_float:
        groups = [text[max(0, i - 4):i] for i in range(len(text), 0, -4)]
        return " ".join(reversed(groups))
    sign_bits = fmt.bits - fmt.exponent_bits - fmt.mantissa_bits
    parts = [text[:sign_bits], text[sign_bits:sign_bits + fmt.exponent_bits], text[sign_bits + fmt.exponent_bits:]]
    return " | ".join(p for p in parts if p)


def overflow_threshold(fmt: Format) -> tuple[float, bool]:
    """(t, strict): values with |x| > t (strict) or >= t round past the largest finite value.

    t is halfway between max and the next step up; under round-to-nearest-even the tie goes to whichever
    of the two has an even mantissa, so the tie overflows when max's mantissa is odd (IEEE formats,
    all ones) and not when it is even (float8_e4m3fn, whose all-ones pattern is NaN)."""
    ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    _, raw = cast(torch.tensor([fmt.max], dtype=torch.float64), fmt)
    return fmt.max + ulp / 2, not bool(raw[0] & 1)
