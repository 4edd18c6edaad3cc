"""Tables for the numeric commands: formats, value casts, file casts and range audits.

Each builder returns (title, headers, rows, notes); ``emit`` turns that into a rich table, Markdown, HTML
or JSON the same way for all of them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dtypelab.core.results import AuditReport, plain_json
from dtypelab.core.text import num, pct
from dtypelab.render import plots
from dtypelab.render.html import details, figure, record_section
from dtypelab.render.tables import drop_order, html_fragment, html_table, markdown_table, rich_table
from dtypelab.render.views import document, more, section

Doc = tuple[str, list[str], list[list[str]], list[str]]
SEVERITY_STYLE = {0: "", 1: "yellow", 2: "bold yellow", 3: "bold red"}



# --- audit -------------------------------------------------------------------------------------
@document(AuditReport)
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
                     pct(s["zeros"] / n), pct(s["nonfinite"] / n), num(span, ".0f")]
                    + [layer.verdicts[f].text for f in cfg.formats])
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
            word = layer.verdicts[fmt].risk.value
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
            text += (f"; gradient values flushed to zero in float16: {pct(ls['flushed_unscaled'])} unscaled, "
                     f"{pct(ls['flushed_at_scale'])} at that scale")
        if ls.get("gradscaler_default_overflows"):
            text += "; GradScaler's default 65536 would overflow at first and back off, skipping steps"
        notes.append(text)
    limits = report.config.limits
    spans = [f"{f} {math.log2(limits[f]['max'] / limits[f]['smallest_subnormal']):.0f}"
             for f in report.config.formats if f.startswith("float8") and f in limits]
    if spans:
        notes.append("fp8 verdicts assume no per-tensor scaling. With scaling, what must fit is the range in "
                     f"binades, log2(max/min non-zero): the formats span {', '.join(spans)} (with subnormals)")
    return notes


@more(AuditReport)
def updates_docs(report: AuditReport, top: int = 0) -> list[Doc]:
    """``audit --updates``: which updates round away, per parameter (most lost first) and storage format; ``top`` > 0
    keeps that many rows."""
    if not report.updates:
        return []
    fmts = list(dict.fromkeys(f for u in report.updates for f in u["lost"]))
    rows = sorted(report.updates, key=lambda u: (-max(u["lost"].values(), default=0.0), u["parameter"]))
    headers = ["parameter", "elements", "stored as", "steps", *(f"lost in {f}" for f in fmts),
               "median |update|/|weight|"]
    body = [[u["parameter"], f"{u['numel']:,}", u["dtype"], str(u["steps"]),
             *(pct(u["lost"][f]) if f in u["lost"] else "—" for f in fmts), num(u["ratio"], ".3g")] for u in rows]
    steps = max((u["steps"] for u in rows), default=0)
    shown = f"; showing the {top} that lose most of {len(rows)}, the JSON has all" if 0 < top < len(rows) else ""
    body = body[:top] if top > 0 else body
    notes = [f"lost: the share of the elements each sampled step meant to move (gradient not zero, or moved) whose "
             f"update is too small to change the weight stored in that format (under half its spacing there), "
             f"over {steps} sampled steps; the update is what the optimizer did in this run ({report.config.policy})"
             f"{shown}"]
    for f in fmts:
        worst = [u for u in rows if u["lost"].get(f, 0.0) >= 0.5]
        if worst and f != "float32":
            names = ", ".join(u["parameter"] for u in worst[:3]) + (", …" if len(worst) > 3 else "")
            notes.append(f"{f} weights would lose most updates of {len(worst)} tensor(s) ({names}): keep them in "
                         "float32 (autocast) or use bf16-sr / bf16-kahan")
    title = f"which updates round away: {report.config.task_name or report.config.task} · {report.config.policy}"
    return [(title, headers, body, notes)]


# --- output ------------------------------------------------------------------------------------
def to_json(obj: Any) -> str:
    """JSON for any of the numeric results (dataclasses, lists of them, or records)."""
    if hasattr(obj, "to_json"):  # records (audit, trace) have their own versioned JSON
        return obj.to_json() + "\n"
    if hasattr(obj, "to_dict"):  # a command's own result type (cast_file's report)
        obj = obj.to_dict()
    return plain_json(obj) + "\n"


# Columns a narrow terminal leaves out first, per table (by the first header): the rest go right to left.
DROP_FIRST = {"layer": ("module", "zero", "range", "min |x|", "non-finite", "max |x|", "kind",  # audit, tune
                        "candidate", "gain", "1 − cosine", "loss deviation"),
              "tensor": ("dtype", "shape", "bytes", "max rel err", "subnormal", "elements"),  # cast
              "format": ("smallest subnormal", "bits", "eps", "digits", "inf/nan", "smallest normal"),
              # forecast: the breakdown's smaller parts first, then where the peak is, then the rest of it
              "policy": ("buffers", "master", "peak in", "temporaries", "gradients", "activations", "optimizer",
                         "weights", "inference measured", "inference forecast", "train measured",
                         # generate: the decode speed, the quality and the fit stay longest
                         "TTFT", "ms/token", "first divergence", "next-token", "prefill", "KV cache")}


def emit(doc: Doc, fmt: str, console: Any, styles: list[str] | None = None, wrap: set[int] | None = None,
         drop: tuple[str, ...] | None = None) -> str | None:
    """Print a rich table (fmt 'table', returns None) or return Markdown / HTML text (``drop``: the header prefixes a
    narrow terminal leaves out first, in order, instead of the table's default)."""
    title, headers, rows, notes = doc
    if fmt == "table" and not headers:  # a sentence with no table under it (a forecast's speed, without rates)
        console.print(title, highlight=False)
        for note in notes:
            console.print(f"• {note}", highlight=False)
        return None
    if fmt == "table":
        last = len(headers) - 1
        wrap = wrap or {last}
        text_columns = {i for i, h in enumerate(headers) if h.startswith(("bits", "what", "note"))}
        first = drop_order(headers, drop if drop is not None else DROP_FIRST.get(headers[0], ()))
        rest = [i for i in range(len(headers) - 1, 0, -1) if i not in wrap and i not in first]
        rich_table(console, title, headers, rows, notes, left={0, 1, 2} | text_columns | wrap, wrap=wrap,
                   styles=styles, drop=first + rest)
        return None
    return (markdown_table if fmt == "markdown" else html_table)(title, headers, rows, notes)


HEATMAP_ROWS = 40  # riskiest tensor families drawn in the audit heat map (the table below lists all)
MAX_HISTOGRAMS = 6


def _histogram_layers(report: AuditReport, pattern: str | None) -> list[Any]:
    """The tensor families to draw binade histograms for: those whose name matches ``pattern`` (at most
    MAX_HISTOGRAMS), else the riskiest of each kind (activation, gradient, parameter gradient)."""
    measured = [layer for layer in report.layers if layer.stats.get("binades")]
    if pattern:
        return [layer for layer in measured if re.search(pattern, layer.name)][:MAX_HISTOGRAMS]
    chosen: dict[str, Any] = {}
    for layer in measured:  # sorted riskiest first
        chosen.setdefault(layer.kind, layer)
    return list(chosen.values())


@section(AuditReport)
def _audit(report: AuditReport, key: str, layers: str | None = None) -> str:
    doc, _, _ = audit_doc(report, 0)
    title, headers, rows, notes = doc
    fmts = list(report.config.formats)
    top = list(report.layers[:HEATMAP_ROWS])
    heat = plots.audit_heatmap([f"{layer.name} ({layer.kind})" for layer in top], fmts,
                               [[layer.verdicts[f].severity if f in layer.verdicts else 0 for f in fmts]
                                for layer in top])
    parts = [figure(heat, f"The {len(top)} riskiest tensor families against each candidate format, coloured by what "
                           "storing their values there would do: look for the columns you want to use.",
                     f"{key}-heatmap")]
    bands = []
    for f in fmts:
        lim = report.config.limits.get(f)
        if lim and lim["smallest_normal"]:
            sub = lim["smallest_subnormal"] or lim["smallest_normal"]
            bands.append((f, math.log2(sub), math.log2(lim["smallest_normal"]), math.log2(lim["max"])))
    for i, layer in enumerate(_histogram_layers(report, layers)):
        why = "chosen with --layer" if layers else f"the riskiest {layer.kind.replace('_', ' ')} measured"
        parts.append(figure(plots.binade_histogram(f"{layer.name} ({layer.kind}), {why}", layer.stats["binades"],
                                                    bands),
                             "Where this tensor's values sit, per power of two, against each format's subnormal and "
                             "normal range: bars left of a format's range flush to zero, right of it overflow.",
                             f"{key}-binades{i + 1}" if i else f"{key}-binades"))
    parts.append(details(f"all {len(rows)} tensor families", html_fragment(headers, rows, notes, classes=True),
                          opened=len(rows) <= 25))
    for more_title, more_headers, more_rows, more_notes in updates_docs(report):  # audit --updates
        parts.append(details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True),
                              opened=True))
    return record_section(title, "".join(parts), report.environment, report.created, key)
