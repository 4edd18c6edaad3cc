"""Tables for the numeric commands: formats, value casts, file casts and range audits.

Each builder returns (title, headers, rows, notes); ``emit`` turns that into a rich table, Markdown, HTML
or JSON the same way for all of them.
"""

from __future__ import annotations

import math
from typing import Any

from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.results import AuditReport, plain_json
from dtypelab.numerics.castcheck import LABELS, CastFileReport, CastReport, ValueCast
from dtypelab.numerics.formats import Format, get_format
from dtypelab.render.tables import drop_order, html_table, markdown_table, num, pow2, rich_table

Doc = tuple[str, list[str], list[list[str]], list[str]]
SEVERITY_STYLE = {0: "", 1: "yellow", 2: "bold yellow", 3: "bold red"}


def _pct(x: float) -> str:
    return "0" if x == 0 else (f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}")


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
    if r.note.startswith("skipped"):
        return [r.name, r.source, "×".join(map(str, r.shape)), f"{r.numel:,}"] + ["—"] * 7 + [r.note]
    c = r.counts
    lost = (c.get("overflow_inf", 0) + c.get("overflow_nan", 0) + c.get("saturated", 0)) if is_float else (
        c.get("wrapped", 0) + c.get("saturated", 0) + c.get("out_of_range", 0))
    small = c.get("underflow_zero", 0) if is_float else c.get("truncated", 0)
    sub = c.get("subnormal", 0) if is_float else 0
    n = r.numel or 1
    return [r.name, r.source, "×".join(map(str, r.shape)) or "—", f"{r.numel:,}", _pct(lost / n), _pct(small / n),
            _pct(sub / n) if is_float else "—", num(r.max_abs_error, ".3g"), num(r.max_rel_error, ".3g"),
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


# --- audit -------------------------------------------------------------------------------------
def audit_doc(report: AuditReport, top: int = 0) -> tuple[Doc, list[str], set[int]]:
    """The per-layer table, riskiest first; ``top`` > 0 keeps only that many rows. Also returns the row
    styles and the columns that wrap in a terminal (the per-format verdicts)."""
    cfg = report.config
    fixed = ["layer", "kind", "module", "max |x|", "min |x|≠0", "zero", "non-finite", "range (binades)"]
    headers = fixed + list(cfg.formats)
    rows, styles = [], []
    shown = report.layers[:top] if top > 0 else report.layers
    for layer in shown:
        s = layer.stats
        n = s["numel"] or 1
        span = (math.log2(s["max_abs"] / s["min_nonzero"]) if s["max_abs"] and math.isfinite(s["min_nonzero"])
                else None)
        rows.append([layer.name, {"activation": "act", "grad": "grad", "param_grad": "param grad"}[layer.kind],
                     layer.module, num(s["max_abs"], ".3g"),
                     num(s["min_nonzero"] if math.isfinite(s["min_nonzero"]) else None, ".3g"),
                     _pct(s["zeros"] / n), _pct(s["nonfinite"] / n), num(span, ".0f")]
                    + [layer.verdicts[f] for f in cfg.formats])
        styles.append(SEVERITY_STYLE[layer.severity])
    every = "every step" if cfg.every == 1 else f"every {cfg.every} steps"
    title = (f"dtypelab audit: {cfg.task_name or cfg.task} · {cfg.policy} · {len(report.losses)} steps, measured "
             f"{every} · {len(report.layers)} tensor families")
    notes = audit_notes(report)
    if len(shown) < len(report.layers):
        notes.insert(0, f"showing the {len(shown)} riskiest of {len(report.layers)} rows; --top 0 shows all, "
                        "the JSON has every row")
    return (title, headers, rows, notes), styles, set(range(len(fixed), len(headers)))


def audit_notes(report: AuditReport) -> list[str]:
    notes = []
    if report.status != "ok":
        notes.append(f"run {report.status}: {report.reason}")
    for fmt in report.config.formats:
        worst = {}
        for layer in report.layers:
            word = layer.verdicts[fmt].split(":")[0]
            if word != "safe":
                label = layer.name if layer.kind == "activation" else f"{layer.name} {layer.kind.replace('_', ' ')}"
                worst.setdefault(word, []).append(label)
        if worst:
            parts = [f"{w} in {len(names)} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
                     for w, names in worst.items()]
            notes.append(f"{fmt}: " + "; ".join(parts))
        else:
            notes.append(f"{fmt}: every measured tensor is safe")
    ls = report.loss_scale
    if ls:
        text = (f"float16 loss scale: start at 2^{ls['log2_scale']} = {ls['scale']:g} (largest gradient "
                f"{ls['max_grad']:.3g}, kept 2x below 65504)")
        if ls.get("flushed_unscaled") is not None:
            text += (f"; gradient values flushed to zero in float16: {_pct(ls['flushed_unscaled'])} unscaled, "
                     f"{_pct(ls['flushed_at_scale'])} at that scale")
        if ls.get("gradscaler_default_overflows"):
            text += "; GradScaler's default 65536 would overflow at first and back off, skipping steps"
        notes.append(text)
    spans = [f"{f} {math.log2(get_format(f).max / get_format(f).smallest_subnormal):.0f}"
             for f in report.config.formats if f.startswith("float8")]
    if spans:
        notes.append("fp8 verdicts assume no per-tensor scaling. With scaling, what must fit is the range in "
                     f"binades, log2(max/min non-zero): the formats span {', '.join(spans)} (with subnormals)")
    return notes


# --- output ------------------------------------------------------------------------------------
def to_json(obj: Any) -> str:
    """JSON for any of the numeric results (dataclasses, lists of them, or records)."""
    if hasattr(obj, "to_json"):  # records (audit, trace) have their own versioned JSON
        return obj.to_json() + "\n"
    if isinstance(obj, CastFileReport):
        obj = {"path": obj.path, "target": obj.target, "rows": [r.to_dict() for r in obj.rows],
               "total": obj.total.to_dict(), "skipped": list(obj.skipped)}
    return plain_json(obj) + "\n"


# Columns a narrow terminal leaves out first, per table (by the first header): the rest go right to left.
DROP_FIRST = {"layer": ("module", "zero", "range", "min |x|", "non-finite", "max |x|", "kind",  # audit, tune
                        "candidate", "gain", "1 − cosine", "loss deviation"),
              "tensor": ("dtype", "shape", "bytes", "max rel err", "subnormal", "elements"),  # cast
              "format": ("smallest subnormal", "bits", "eps", "digits", "inf/nan", "smallest normal")}


def emit(doc: Doc, fmt: str, console: Any, styles: list[str] | None = None, wrap: set[int] | None = None) -> str | None:
    """Print a rich table (fmt 'table', returns None) or return Markdown / HTML text."""
    title, headers, rows, notes = doc
    if fmt == "table":
        last = len(headers) - 1
        wrap = wrap or {last}
        text_columns = {i for i, h in enumerate(headers) if h.startswith(("bits", "what", "note"))}
        first = drop_order(headers, DROP_FIRST.get(headers[0], ()))
        rest = [i for i in range(len(headers) - 1, 0, -1) if i not in wrap and i not in first]
        rich_table(console, title, headers, rows, notes, left={0, 1, 2} | text_columns | wrap, wrap=wrap,
                   styles=styles, drop=first + rest)
        return None
    return (markdown_table if fmt == "markdown" else html_table)(title, headers, rows, notes)
