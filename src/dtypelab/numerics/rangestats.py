"""Range statistics of a tensor against several formats at once.

Every question ("how many values would overflow / flush to zero / become subnormal in format F?") is a
count of |x| above a threshold. For non-negative IEEE floats the bit pattern orders like the value, so
the thresholds of all formats become integers, sorted once, and compared against the tensor's bits:
vectorised passes over the tensor, never a Python loop over elements or a cast per format. Rounding
ties follow round-to-nearest-even, so the counts equal what a cast does, exactly (tested against casts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.numerics.catalog import Format, get_format, overflow_threshold

# Carrier: the float type statistics are computed in. float32 holds float16 / bfloat16 exactly.
_CARRIERS = {torch.float32: (np.float32, np.int32, 23, 8), torch.float64: (np.float64, np.int64, 52, 11)}
KINDS = ("overflow", "underflow", "subnormal")
HISTOGRAM_SAMPLE = 8192  # values per tensor the binade histogram is estimated from, at most


def _strict_bound(t: float, strict: bool, np_float: type) -> int:
    """Integer T with count(|x| > t) [strict] or count(|x| >= t) equal to count(bits(|x|) > T)."""
    c = np_float(t)
    # step down one value when t rounded up to the carrier's grid, or when t itself must count (>=)
    if float(c) > t or (float(c) == t and not strict):
        c = np.nextafter(c, np_float(0))
    return int(np.array([c]).view({np.float32: np.int32, np.float64: np.int64}[np_float])[0])


def format_thresholds(fmt: Format) -> dict[str, tuple[float, bool]]:
    """(value, strict) per kind: overflow counts |x| beyond the value; underflow and subnormal count
    |x| above it (the caller takes complements)."""
    if not fmt.is_float or fmt.smallest_subnormal is None:
        raise DtypelabError(f"{fmt.name} has no subnormal range: range statistics need a float format "
                            "with zero and subnormals (e.g. float16, bfloat16, float8_e4m3fn, float8_e5m2)")
    s, n = fmt.smallest_subnormal, fmt.smallest_normal
    return {"overflow": overflow_threshold(fmt),
            "underflow": (s / 2, True),  # s/2 ties to 0 (even): underflow is |x| <= s/2
            "subnormal": (n - s / 2, False)}  # the largest subnormal is odd: the tie rounds up to normal


@dataclass(frozen=True)
class _Plan:
    names: tuple[str, ...]
    bounds: tuple[int, ...]  # sorted int bit patterns T; a count is always count(bits > T)
    slot: dict[tuple[str, str], int]  # (format, kind) -> position in bounds


@cache
def _plan(names: tuple[str, ...], carrier: torch.dtype) -> _Plan:
    np_float = _CARRIERS[carrier][0]
    raw: dict[tuple[str, str], int] = {}
    for name in names:
        for kind, (t, strict) in format_thresholds(get_format(name)).items():
            raw[(name, kind)] = _strict_bound(t, strict, np_float)
    ordered = sorted(set(raw.values()))
    return _Plan(names, tuple(ordered), {k: ordered.index(v) for k, v in raw.items()})


@dataclass
class RangeStats:
    """Mergeable statistics of |x| for one tensor (or many, merged). Counts are over elements."""

    formats: tuple[str, ...]
    numel: int = 0
    zeros: int = 0
    nonfinite: int = 0
    max_abs: float = 0.0  # largest finite |x|
    min_nonzero: float = math.inf  # smallest non-zero finite |x|
    # binade histogram: exponent k -> count of finite non-zero |x| in [2^k, 2^(k+1)); the lowest key
    # holds the carrier's own subnormals. Exact up to HISTOGRAM_SAMPLE values per tensor, estimated above.
    binades: dict[int, int] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # format -> kind -> count

    def merge(self, other: RangeStats) -> None:
        self.numel += other.numel
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite
        self.max_abs = max(self.max_abs, other.max_abs)
        self.min_nonzero = min(self.min_nonzero, other.min_nonzero)
        for k, v in other.binades.items():
            self.binades[k] = self.binades.get(k, 0) + v
        for f, kinds in other.counts.items():
            mine = self.counts.setdefault(f, dict.fromkeys(KINDS, 0))
            for k, v in kinds.items():
                mine[k] += v

    def fraction(self, fmt: str, kind: str) -> float:
        return self.counts[fmt][kind] / self.numel if self.numel else 0.0

    def to_dict(self) -> dict:
        return {"formats": list(self.formats), "numel": self.numel, "zeros": self.zeros,
                "nonfinite": self.nonfinite, "max_abs": self.max_abs, "min_nonzero": self.min_nonzero,
                "binades": {str(k): v for k, v in sorted(self.binades.items())}, "counts": self.counts}

    @classmethod
    def from_dict(cls, d: dict) -> RangeStats:
        return cls(tuple(d["formats"]), d["numel"], d["zeros"], d["nonfinite"], d["max_abs"], d["min_nonzero"],
                   {int(k): v for k, v in d["binades"].items()}, {f: dict(k) for f, k in d["counts"].items()})


class RangeCounter:
    """Computes RangeStats for many tensors against fixed formats, reusing scratch buffers.

    Per tensor: one pass for |x| as bits, one for min and max, and one compare-and-count per threshold
    that lies inside [min, max] (thresholds outside cost nothing). The work is done in NumPy on a
    zero-copy view: per call it costs microseconds where torch's dispatcher costs tens, and an audit
    makes thousands of calls on small tensors. Scratch buffers are reused because fresh multi-megabyte
    arrays are page-faulted in on every call. CUDA tensors are copied to the host first.
    """

    def __init__(self, formats: tuple[str, ...] | list[str]) -> None:
        self.formats = tuple(formats)
        for carrier in _CARRIERS:
            _plan(self.formats, carrier)  # validate the formats now, not mid-training
        self._scratch: dict[tuple[type, int], np.ndarray] = {}

    def _buffer(self, dtype: type, n: int, slot: int) -> np.ndarray:
        buf = self._scratch.get((dtype, slot))
        if buf is None or buf.size < n:
            buf = self._scratch[(dtype, slot)] = np.empty(n, dtype=dtype)
        return buf[:n]

    @staticmethod
    def _binades(bits: np.ndarray, shift: int, ebits: int, finite_nonzero: int) -> dict[int, int]:
        """Binade histogram of the non-zero values. Above HISTOGRAM_SAMPLE values it is estimated from
        an evenly strided sample, scaled to the exact non-zero count: a bincount is the costliest pass
        there is, and the histogram only feeds the loss-scale advice."""
        stride = max(1, bits.size // HISTOGRAM_SAMPLE)
        sample = bits[::stride] >> shift
        counts = np.bincount(sample)
        counts[0] -= sample.size - np.count_nonzero(bits[::stride])  # zeros (and zeroed inf/NaN)
        total = int(counts.sum())
        if not total:
            return {}
        bias = (1 << (ebits - 1)) - 1  # exponent field 0 holds the carrier's subnormals: binade -bias
        nz = np.flatnonzero(counts)
        scaled = counts[nz] if stride == 1 else np.rint(counts[nz] * (finite_nonzero / total)).astype(np.int64)
        return dict(zip((nz - bias).tolist(), scaled.tolist(), strict=True))

    def __call__(self, x: torch.Tensor, histogram: bool = False) -> RangeStats | None:
        """Statistics of x; None for integer, bool and complex tensors (nothing to round).
        ``histogram`` adds the binade histogram (see _binades)."""
        if not x.is_floating_point() or x.is_complex():
            return None
        carrier = torch.float64 if x.dtype == torch.float64 else torch.float32
        np_float, np_int, shift, ebits = _CARRIERS[carrier]
        plan = _plan(self.formats, carrier)
        src = x.detach()
        if src.dtype != carrier or src.device.type != "cpu":
            src = src.to("cpu", carrier)
        src = src.reshape(-1).contiguous().numpy().view(np_int)
        n = src.size
        stats = RangeStats(self.formats, numel=n)
        maxint = (1 << (8 * np.dtype(np_int).itemsize - 1)) - 1
        inf_bits = ((1 << ebits) - 1) << shift
        bits = np.bitwise_and(src, maxint, out=self._buffer(np_int, n, 0))
        lo, hi = (int(bits.min()), int(bits.max())) if n else (0, 0)
        if hi >= inf_bits:  # rare: inf or NaN present; measure the finite part
            finite = bits < inf_bits
            stats.nonfinite = n - int(np.count_nonzero(finite))
            bits = np.where(finite, bits, 0)
            hi = int(bits.max())
        if lo == 0:
            stats.zeros = n - stats.nonfinite - int(np.count_nonzero(bits))
        finite_nonzero = n - stats.zeros - stats.nonfinite
        above = [0] * len(plan.bounds)
        if finite_nonzero:
            if lo == 0:  # (bits - 1) & maxint sends zero to the top, so min finds the smallest non-zero
                scratch = self._buffer(np_int, n, 1)
                lo = int(np.bitwise_and(np.subtract(bits, 1, out=scratch), maxint, out=scratch).min()) + 1
            flags = self._buffer(np.bool_, n, 2)
            for j, bound in enumerate(plan.bounds):  # zeros (and zeroed inf/NaN) are never above a bound
                if bound < lo:
                    above[j] = finite_nonzero
                elif bound < hi:
                    above[j] = int(np.count_nonzero(np.greater(bits, bound, out=flags)))
            stats.max_abs, stats.min_nonzero = np.array([hi, lo], dtype=np_int).view(np_float).tolist()
            if histogram:
                stats.binades = self._binades(bits, shift, ebits, finite_nonzero)
        for name in plan.names:
            o, u, s = (above[plan.slot[(name, k)]] for k in KINDS)
            stats.counts[name] = {"overflow": o, "underflow": finite_nonzero - u, "subnormal": u - s}
        return stats


def range_stats(x: torch.Tensor, formats: tuple[str, ...] | list[str], histogram: bool = False) -> RangeStats | None:
    """Statistics of x against every format at once (see RangeCounter)."""
    return RangeCounter(formats)(x, histogram)
