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


def size_text(n: int) -> str:
    """A size in a sentence, in decimal units as datasheets give them: 107.8 GB, 56.6 MB, 18.4 kB."""
    if abs(n) >= 1e9:
        return f"{n / 1e9:.4g} GB"
    return f"{n / 1e6:.3g} MB" if abs(n) >= 1e6 else f"{n / 1e3:.3g} kB"
