"""The numerics capability's own command output as documents (title, headers, rows, notes): the format table, what
values and a checkpoint's tensors become in a format. ``dtypelab.render`` prints them (``render.numeric.emit``)."""

from __future__ import annotations

from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.text import num, pct, pow2
from dtypelab.numerics.castcheck import LABELS, CastFileReport, CastReport, ValueCast
from dtypelab.numerics.catalog import Format

Doc = tuple[str, list[str], list[list[str]], list[str]]


# --- formats -----------------------------------------------------------------------------------
def _native(fmt: Format, hw: HardwareInfo | None) -> str:
    if hw is None:
        return "—"
    text = {True: "yes", False: "no", None: "—"}[hw.native(fmt.name)]
    if fmt.name in hw.gflops and hw.gflops.get("float32"):
        text += f" ({hw.gflops[fmt.name] / hw.gflops['float32']:.2g}x fp32 matmul)"
    return text


def formats_doc(formats: list[Format], hw: HardwareInfo | None) -> Doc:
    headers = ["format", "bits s/e/m", "max", "smallest normal", "smallest subnormal", "eps", "digits",
               "inf/nan", f"native on {hw.device if hw else 'this machine'}", "note"]
    rows = []
    for f in formats:
        sign = f.bits - f.exponent_bits - f.mantissa_bits if f.is_float else None
        layout = f"{f.bits}: {sign}/{f.exponent_bits}/{f.mantissa_bits}" if f.is_float else f"{f.bits} int"
        special = "/".join(t for t, ok in (("inf", f.has_inf), ("nan", f.has_nan)) if ok) or "none"
        rows.append([f.name, layout, num(f.max, ".6g"), pow2(f.smallest_normal), pow2(f.smallest_subnormal),
                     pow2(f.eps), f"{f.decimal_digits:.1f}", special if f.is_float else "—", _native(f, hw), f.note])
    notes = ["digits: significant decimal digits, (mantissa bits + 1)·log10(2); eps: gap between 1 and the next "
             "value", "native: from CPU flags / CUDA capability; the ratio is measured matmul throughput"]
    return "numeric formats (computed from torch, numpy and ml_dtypes)", headers, rows, notes


def values_doc(casts: list[ValueCast]) -> Doc:
    headers = ["value", "format", "stored", "bits (sign | exponent | mantissa)", "abs error", "rel error",
               "what happened"]
    rows = [[num(c.value, ".10g"), c.format, num(c.stored, ".10g"), c.bits, num(c.abs_error, ".3g"),
             num(c.rel_error, ".3g"), LABELS.get(c.outcome, c.outcome)] for c in casts]
    return "values stored in each format", headers, rows, []


# --- cast --------------------------------------------------------------------------------------
def _cast_row(r: CastReport, is_float: bool) -> list[str]:
    if r.skipped:
        return [r.name, r.source, "×".join(map(str, r.shape)), f"{r.numel:,}"] + ["—"] * 7 + [r.note]
    c = r.counts
    lost = (c.get("overflow_inf", 0) + c.get("overflow_nan", 0) + c.get("saturated", 0)) if is_float else (
        c.get("wrapped", 0) + c.get("saturated", 0) + c.get("out_of_range", 0))
    small = c.get("underflow_zero", 0) if is_float else c.get("truncated", 0)
    sub = c.get("subnormal", 0) if is_float else 0
    n = r.numel or 1
    return [r.name, r.source, "×".join(map(str, r.shape)) or "—", f"{r.numel:,}", pct(lost / n), pct(small / n),
            pct(sub / n) if is_float else "—", num(r.max_abs_error, ".3g"), num(r.max_rel_error, ".3g"),
            num(r.sqnr_db, ".1f"), f"{r.bytes_before:,} → {r.bytes_after:,}", r.note]


def cast_doc(report: CastFileReport, fmt: Format) -> Doc:
    f = fmt.is_float
    headers = ["tensor", "dtype", "shape", "elements", "overflow/saturate" if f else "wrapped/out of range",
               "flushed to zero" if f else "truncated", "subnormal", "max abs err", "max rel err", "SQNR dB",
               "bytes", "note"]
    rows = [_cast_row(r, f) for r in report.rows]
    if len(report.rows) > 1:
        rows.append(_cast_row(report.total, f))
    notes = []
    t = report.total
    if not f:
        notes.append(f"a raw cast to {fmt.name} truncates toward zero; quantization (scale, round, clamp) is a "
                     "different operation")
    if f and t.counts.get("saturated"):
        notes.append(f"{fmt.name} has no infinity: PyTorch saturates overflow to ±{fmt.max:g}")
    if report.skipped:
        notes.append(f"not tensors, skipped: {', '.join(report.skipped[:10])}")
    return f"{report.path} → {report.target}", headers, rows, notes


