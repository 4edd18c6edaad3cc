"""Numbers as people read them in tables and notes, shared by every renderer and by the capabilities that lay out
their own command output."""

from __future__ import annotations

import math
from decimal import Decimal


def num(x: float | None, fmt: str = ".4g") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    text = format(x, fmt)
    return text.lstrip("-") if float(text.replace(",", "")) == 0 else text  # no "-0.0" for tiny negatives


def pow2(x: float | None) -> str:
    """A power of two as people check it: '2^-7 = 0.0078125' (exact when that takes at most 12 digits, else
    '2^-24 ≈ 5.96e-08'); any other value as ``num`` prints it."""
    if x is None or not isinstance(x, float | int) or not math.isfinite(x) or x <= 0 or math.frexp(x)[0] != 0.5:
        return num(x)
    exponent = math.frexp(x)[1] - 1
    exact = Decimal(x).normalize()
    if len(exact.as_tuple().digits) <= 12:
        return f"2^{exponent} = {exact:f}"
    return f"2^{exponent} ≈ {x:.4g}"


def pct(x: float) -> str:
    """A small fraction readably: 0, 1.23%, or 4.6e-05 below 0.01%."""
    return "0" if x == 0 else (f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}")


KIB, MIB, GIB = 2**10, 2**20, 2**30  # bytes: dtypelab's one unit of memory, binary as torch and nvidia-smi report it


def size_text(n: float | None) -> str:
    """A number of bytes with its unit named, binary as torch and nvidia-smi report memory: 100.4 GiB, 54 MiB,
    18 KiB ("unknown" for None). dtypelab's one byte formatter: sentences, cells and messages alike."""
    if n is None:
        return "unknown"
    if abs(n) >= GIB:
        return f"{n / GIB:.4g} GiB"
    return f"{n / MIB:.3g} MiB" if abs(n) >= MIB else f"{n / KIB:.3g} KiB"


def size_unit(values: list[int]) -> tuple[int, str]:
    """The unit a table of sizes is shown in: GiB when any reaches one, KiB when all are below a MiB, else MiB."""
    top = max((abs(v) for v in values), default=0)
    return (GIB, "GiB") if top >= GIB else (KIB, "KiB") if values and top < MIB else (MIB, "MiB")
