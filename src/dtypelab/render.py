"""Renderers: terminal table, Markdown, HTML and JSON. They only read Report records."""

from __future__ import annotations

import html
import math

from .policies import BASELINE
from .recommend import Recommendation, Tolerance, delta_text, recommend, speedup
from .results import PolicyResult, Report

FORMATS = ("table", "markdown", "html", "json")
MB = 2**20


def num(x: float | None, fmt: str = ".4g") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    text = format(x, fmt)
    return text.lstrip("-") if float(text.replace(",", "")) == 0 else text  # no "-0.0" for tiny negatives


def _timing(r: PolicyResult) -> str:
    t = r.timing
    if t is None:
        return "—"
    text = f"{t.median * 1e3:.3g} ± {t.iqr * 1e3:.2g}"
    return text + " *" if t.noisy else text  # footnoted below the table


def _delta(r: PolicyResult, base: PolicyResult | None, metric: str, tol: Tolerance) -> str:
    v, b = r.metric(metric), base.metric(metric) if base else None
    if v is None or b is None or r.policy == BASELINE or not (math.isfinite(v) and math.isfinite(b)):
        return "—"
    return delta_text(v, b, tol)


def table_rows(report: Report, rec: Recommendation) -> tuple[list[str], list[list[str]]]:
    """Headers and cell texts shared by every renderer."""
    cfg = report.config
    metric = cfg.metric + (" ↑" if cfg.higher_is_better else " ↓")
    base = report.result(BASELINE)
    tol = Tolerance.parse(cfg.tolerance)
    infer = cfg.mode == "infer"
    headers = ["policy", "status", "latency ms (median ± IQR)" if infer else "step ms (median ± IQR)",
               "speedup", "samples/s", "peak MB", "size MB"]
    headers += ["max abs err", "SQNR dB"] if infer else ["final loss"]
    headers += [metric, f"Δ {cfg.metric}", "verdict"]
    rows = []
    for r in report.results:
        sp = speedup(r, base) if base and r.ran else None
        row = [r.policy, r.status, _timing(r), f"{sp:.2f}x" if sp else "—", num(r.throughput, ",.0f"),
               num(r.peak_memory_bytes / MB if r.peak_memory_bytes is not None else None, ".1f"),
               num(r.model_bytes / MB if r.model_bytes is not None else None, ".3f")]
        if infer:
            row += [num(r.fidelity.get("max_abs_err"), ".3g"), num(r.fidelity.get("sqnr_db"), ".1f")]
        else:
            row += [num(r.final_loss, "#.4g")]
        row += [num(r.metric(cfg.metric)), _delta(r, base, cfg.metric, tol), rec.verdicts.get(r.policy, "")]
        rows.append(row)
    return headers, rows


def _title(report: Report) -> str:
    cfg, hw = report.config, report.environment.get("hardware", {})
    what = "inference" if cfg.mode == "infer" else "training"
    return (f"dtypelab {what}: {cfg.task} · {cfg.steps} steps × batch {cfg.batch_size} · "
            f"{hw.get('device_name') or cfg.device} · torch {report.environment.get('torch', '?')}")


def _notes(report: Report, rec: Recommendation) -> list[str]:
    notes = list(rec.sentences)
    if any(r.timing and r.timing.noisy for r in report.results):
        notes.append("* noisy timing: IQR above 10% of the median; compare such policies with care.")
    return notes


def markdown_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    def cells(row: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

    lines = [f"**{title}**", "", cells(headers), "|" + "|".join("---" for _ in headers) + "|"]
    lines += [cells(row) for row in rows]
    lines += [""] + [f"- {s}" for s in notes] if notes else []
    return "\n".join(lines) + "\n"


def html_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    items = "".join(f"<li>{esc(s)}</li>" for s in notes)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>dtypelab report</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child"
        "{text-align:left}</style></head><body>"
        f"<h2>{esc(title)}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"<ul>{items}</ul></body></html>\n"
    )


def rich_table(console: object, title: str, headers: list[str], rows: list[list[str]], notes: list[str],
               left: set[int] = frozenset({0}), wrap: set[int] = frozenset(), styles: list[str] | None = None) -> None:
    """Print with rich: numbers right-aligned and never wrapped; only the ``wrap`` columns give way."""
    from rich.table import Table

    # A table narrower than its title would fold the title; widen it up to the console's width.
    table = Table(title=title, title_justify="left", min_width=min(len(title), console.width))
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i in left else "right", no_wrap=i not in wrap, overflow="fold")
    for i, row in enumerate(rows):
        table.add_row(*row, style=styles[i] if styles else "")
    console.print(table)
    for s in notes:
        console.print(s if s.startswith("*") else f"• {s}", highlight=False)


def render_markdown(report: Report) -> str:
    rec = recommend(report)
    headers, rows = table_rows(report, rec)
    return markdown_table(_title(report), headers, rows, _notes(report, rec))


def render_html(report: Report) -> str:
    rec = recommend(report)
    headers, rows = table_rows(report, rec)
    return html_table(_title(report), headers, rows, _notes(report, rec))


def render_json(report: Report) -> str:
    return report.to_json() + "\n"


def render_table(report: Report, console: object | None = None) -> None:
    """Print the table and the recommendation with rich."""
    from rich.console import Console

    console = console or Console()
    rec = recommend(report)
    headers, rows = table_rows(report, rec)
    colours = {"ok": "", "diverged": "red", "failed": "red", "timeout": "red", "oom": "red",
               "skipped": "dim", "interrupted": "yellow"}
    styles = ["bold green" if r.policy == rec.best else colours.get(r.status, "") for r in report.results]
    last = len(headers) - 1  # the verdict column gives way instead of the numbers
    rich_table(console, _title(report), headers, rows, _notes(report, rec), left={0, 1, last}, wrap={last},
               styles=styles)


def render(report: Report, fmt: str) -> str:
    """Text of the report in a non-terminal format."""
    return {"markdown": render_markdown, "html": render_html, "json": render_json}[fmt](report)
