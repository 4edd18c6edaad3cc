"""What a conversion does to values: per element (``formats --value``), per tensor (``cast_report``) and
per file (``cast_file``). Every count comes from doing the actual cast, then comparing."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.numerics.catalog import Format, bit_fields, cast, get_format, overflow_threshold

# Outcomes, in the order a single value is labelled by (first match wins).
FLOAT_OUTCOMES = ("nan_input", "inf_input", "overflow_inf", "overflow_nan", "saturated", "underflow_zero",
                  "subnormal", "rounded")
INT_OUTCOMES = ("nonfinite_input", "wrapped", "saturated", "out_of_range", "truncated", "rounded")
LABELS = {
    "nan_input": "NaN in", "inf_input": "inf in", "overflow_inf": "overflow → inf", "overflow_nan": "overflow → NaN",
    "saturated": "saturated to ±max", "underflow_zero": "flushed to zero", "subnormal": "subnormal",
    "rounded": "rounded", "nonfinite_input": "non-finite in", "wrapped": "wrapped around",
    "out_of_range": "out of range", "truncated": "fraction truncated", "exact": "exact",
}


def classify(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Cast x to fmt (from its own dtype, as ``.to()`` would); return (x as float64, result as float64,
    raw bits, {outcome: boolean mask}). Masks may overlap."""
    x64 = x.detach().cpu().to(torch.float64)
    y, raw = cast(x.detach().cpu() if fmt.backend == "torch" else x64, fmt)
    finite = torch.isfinite(x64)
    if fmt.is_float:
        t, strict = overflow_threshold(fmt)
        beyond = finite & ((x64.abs() > t) if strict else (x64.abs() >= t))
        masks = {"nan_input": torch.isnan(x64), "inf_input": torch.isinf(x64),
                 "overflow_inf": finite & torch.isinf(y), "overflow_nan": finite & torch.isnan(y),
                 "saturated": beyond & torch.isfinite(y),
                 "underflow_zero": finite & (x64 != 0) & (y == 0),
                 "subnormal": (torch.isfinite(y) & (y != 0) & (y.abs() < fmt.smallest_normal)
                               if fmt.smallest_subnormal is not None else torch.zeros_like(finite))}
    else:
        trunc = torch.trunc(torch.where(finite, x64, 0.0))
        out = finite & ((trunc < fmt.min) | (trunc > fmt.max))
        span = 2.0 ** fmt.bits
        wrapped = torch.remainder(trunc - fmt.min, span) + fmt.min  # two's complement wrap-around
        masks = {"nonfinite_input": ~finite, "wrapped": out & (y == wrapped),
                 "saturated": out & (y == trunc.clamp(fmt.min, fmt.max)) & (y != wrapped)}
        masks["out_of_range"] = out & ~masks["wrapped"] & ~masks["saturated"]
        masks["truncated"] = finite & ~out & (x64 != trunc)
    masks["rounded"] = finite & torch.isfinite(y) & (y != x64)
    return x64, y, raw, masks


def _label(masks: dict[str, torch.Tensor], order: tuple[str, ...]) -> str:
    """The outcome of a single value: the first mask in ``order`` that is set."""
    return next((k for k in order if bool(masks[k].reshape(-1)[0])), "exact")


@dataclass(frozen=True)
class ValueCast:
    value: float
    format: str
    stored: float
    bits: str
    abs_error: float
    rel_error: float
    outcome: str  # key of LABELS


def analyze_values(values: list[float], formats: list[Format]) -> list[ValueCast]:
    """Each value stored in each format: what comes back, its bits, the error and what happened."""
    out = []
    for v in values:
        x = torch.tensor([v], dtype=torch.float64)
        for fmt in formats:
            _, y, raw, masks = classify(x, fmt)
            stored = float(y[0])
            err = abs(stored - v) if math.isfinite(stored) and math.isfinite(v) else math.inf
            if math.isnan(v):
                err = math.nan
            rel = err / abs(v) if v and math.isfinite(v) else (0.0 if err == 0 else math.nan)
            out.append(ValueCast(v, fmt.name, stored, bit_fields(int(raw[0]), fmt), err, rel,
                                 _label(masks, FLOAT_OUTCOMES if fmt.is_float else INT_OUTCOMES)))
    return out


@dataclass(frozen=True)
class CastReport:
    name: str
    source: str
    target: str
    shape: tuple[int, ...]
    numel: int
    counts: dict[str, int]  # outcome -> elements (outcomes overlap: "rounded" includes most others)
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    # Energies as 10·log10(sum of squares): the sums themselves overflow float64 for values near 1e155 and up
    # (1e300² is inf), so they are kept in decibels and totals combine them in that domain.
    signal_db: float = -math.inf  # sum x² over finite inputs; -inf when it is 0
    noise_db: float = -math.inf  # sum (x − cast(x))²; +inf when a finite input became non-finite
    bytes_before: int = 0
    bytes_after: int = 0
    note: str = ""
    skipped: bool = False  # not a numeric tensor (complex, bool): nothing was cast

    @property
    def sqnr_db(self) -> float | None:
        if not self.numel or self.signal_db == -math.inf:
            return None
        if self.noise_db == -math.inf:
            return math.inf
        if self.noise_db == math.inf:
            return -math.inf  # a finite value became ±inf or NaN: no finite error describes that
        return self.signal_db - self.noise_db

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sqnr_db": self.sqnr_db}


def energy_db(x: torch.Tensor) -> float:
    """10·log10(sum of x²), computed without overflow: scaled by the largest |x| first."""
    x = x.double()
    scale = float(x.abs().max()) if x.numel() else 0.0
    if scale == 0.0:
        return -math.inf
    return 20 * math.log10(scale) + 10 * math.log10(float(((x / scale) ** 2).sum()))


def sum_db(values: list[float]) -> float:
    """10·log10 of the sum of the energies given in dB (log-sum-exp, so nothing overflows)."""
    finite = [v for v in values if v != -math.inf]
    if not finite:
        return -math.inf
    top = max(finite)
    if top == math.inf:
        return math.inf
    return top + 10 * math.log10(sum(10 ** ((v - top) / 10) for v in finite))


def _packed_bytes(numel: int, fmt: Format) -> int:
    return math.ceil(numel * fmt.bits / 8) if fmt.bits < 8 else numel * fmt.storage_bits // 8


def cast_report(tensor: torch.Tensor, dtype: str | torch.dtype | Format, name: str = "") -> CastReport:
    """What converting ``tensor`` to ``dtype`` does: outcome counts, errors, SQNR and bytes."""
    fmt = dtype if isinstance(dtype, Format) else get_format(str(dtype))
    src = str(tensor.dtype).removeprefix("torch.")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        return CastReport(name, src, fmt.name, tuple(tensor.shape), tensor.numel(), {}, note=f"skipped: {src}",
                          skipped=True)
    x, y, _, masks = classify(tensor, fmt)
    x, y = x.reshape(-1), y.reshape(-1)
    finite_in = torch.isfinite(x)
    both = finite_in & torch.isfinite(y)
    lost = bool((finite_in & ~torch.isfinite(y)).any())
    err = (y[both] - x[both]).abs()
    denom = x[both].abs()
    nz = denom > 0
    counts = {k: int(m.sum()) for k, m in masks.items()}
    note = ""
    if not fmt.is_float and counts["wrapped"] + counts["saturated"] + counts["out_of_range"]:
        note = (f"out-of-range values: {counts['wrapped']} wrapped modulo 2^{fmt.bits}, {counts['saturated']} "
                f"saturated, {counts['out_of_range']} other; C++ leaves float→int overflow undefined, "
                "this is what PyTorch did here")
    return CastReport(
        name=name, source=src, target=fmt.name, shape=tuple(tensor.shape), numel=tensor.numel(), counts=counts,
        max_abs_error=math.inf if lost else (float(err.max()) if err.numel() else 0.0),
        max_rel_error=math.inf if lost else (float((err[nz] / denom[nz]).max()) if bool(nz.any()) else 0.0),
        signal_db=energy_db(x[finite_in]), noise_db=math.inf if lost else energy_db(err),
        bytes_before=tensor.numel() * tensor.element_size(), bytes_after=_packed_bytes(tensor.numel(), fmt),
        note=note)


@dataclass(frozen=True)
class CastFileReport:
    path: str
    target: str
    rows: tuple[CastReport, ...]
    total: CastReport
    skipped: tuple[str, ...] = field(default=())  # non-tensor entries of a checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "target": self.target, "rows": [r.to_dict() for r in self.rows],
                "total": self.total.to_dict(), "skipped": list(self.skipped)}


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], skipped: list[str]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix or "tensor"] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out, skipped)
    elif prefix:
        skipped.append(prefix)


def load_tensors(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors in a .pt/.pth/.bin (weights_only), .safetensors, .npy or .npz file, by dotted name."""
    if not os.path.exists(path):
        raise DtypelabError(f"no such file: {path}")
    ext = os.path.splitext(path)[1].lower()
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    try:
        if ext in (".pt", ".pth", ".bin", ".ckpt"):
            _flatten(torch.load(path, map_location="cpu", weights_only=True), "", out, skipped)
        elif ext == ".safetensors":
            from safetensors.torch import load_file

            out = load_file(path)
        elif ext in (".npy", ".npz"):
            data = np.load(path, allow_pickle=False)
            arrays = {"array": data} if ext == ".npy" else {k: data[k] for k in data.files}
            out = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        else:
            raise DtypelabError(f"{path}: unsupported file type {ext or '(none)'}; "
                                "use .pt/.pth/.bin, .safetensors, .npy or .npz")
    except DtypelabError:
        raise
    except Exception as exc:  # corrupt file, pickled objects refused by weights_only, object arrays
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DtypelabError(f"cannot read {path}: {first[:300]}") from None
    if not out:
        raise DtypelabError(f"{path} holds no tensors")
    return out, skipped


def cast_file(path: str, to: str, progress: Callable[[int, int], None] | None = None) -> CastFileReport:
    """``cast_report`` for every tensor in a file, plus a total; ``progress(done, total)`` in elements."""
    fmt = get_format(to)
    tensors, skipped = load_tensors(path)
    total_elements, done, rows_list = sum(t.numel() for t in tensors.values()), 0, []
    for name, t in tensors.items():
        rows_list.append(cast_report(t, fmt, name))
        done += t.numel()
        if progress:
            progress(done, total_elements)
    rows = tuple(rows_list)
    ran = [r for r in rows if not r.skipped]
    counts: dict[str, int] = {}
    for r in ran:
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
    errs = [r.max_abs_error for r in ran if r.max_abs_error is not None]
    rels = [r.max_rel_error for r in ran if r.max_rel_error is not None]
    total = CastReport(
        "total", "", fmt.name, (), sum(r.numel for r in ran), counts, max(errs, default=None),
        max(rels, default=None), sum_db([r.signal_db for r in ran]), sum_db([r.noise_db for r in ran]),
        sum(r.bytes_before for r in rows), sum(r.bytes_after if r in ran else r.bytes_before for r in rows))
    return CastFileReport(path, fmt.name, rows, total, tuple(skipped))
