"""Table building blocks every renderer shares: number formatting, Markdown, HTML and rich tables."""

from __future__ import annotations

import html
import math
import re
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


def markdown_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    def cells(row: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

    lines = [f"**{title}**", "", cells(headers), "|" + "|".join("---" for _ in headers) + "|"]
    lines += [cells(row) for row in rows]
    lines += [""] + [f"- {s}" for s in notes] if notes else []
    return "\n".join(lines) + "\n"


NUMERIC = re.compile(r"^[-+−]?(\d[\d,]*\.?\d*(e[-+]?\d+)?|inf|nan|—)( ?(x|%|MB|ms|dB|s))?( [±(].*)?( [*†])?$", re.I)


def html_fragment(headers: list[str], rows: list[list[str]], notes: list[str], classes: bool = False) -> str:
    """The table and its notes as HTML elements, every text escaped. ``classes``: mark each cell "n" (a number:
    right-aligned, unbroken) or "t" (text: left-aligned, wraps), for pages whose tables mix the two."""
    esc = html.escape

    def cell(c: str) -> str:
        if not classes:
            return f"<td>{esc(c)}</td>"
        return f"<td class='{'n' if NUMERIC.match(c.strip()) else 't'}'>{esc(c)}</td>"

    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(str(c)) for c in row) + "</tr>" for row in rows)
    items = "".join(f"<li>{esc(s)}</li>" for s in notes)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><ul>{items}</ul>"


def html_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>dtypelab report</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child"
        "{text-align:left}</style></head><body>"
        f"<h2>{html.escape(title)}</h2>{html_fragment(headers, rows, notes)}</body></html>\n"
    )


def rich_table(console: object, title: str, headers: list[str], rows: list[list[str]], notes: list[str],
               left: set[int] = frozenset({0}), wrap: set[int] = frozenset(), styles: list[str] | None = None) -> None:
    """Print with rich: numbers right-aligned and never wrapped; only the ``wrap`` columns give way.

    Every string is passed as ``Text``, never as markup: cells hold user code (``torch.cat([x, y])``), layer
    names (``blocks[0]``) and reasons, which rich would otherwise parse as ``[style]`` tags and drop."""
    from rich.table import Table
    from rich.text import Text

    # A table narrower than its title would fold the title; widen it up to the console's width.
    table = Table(title=Text(title), title_justify="left", min_width=min(len(title), console.width))
    for i, h in enumerate(headers):
        table.add_column(Text(h), justify="left" if i in left else "right", no_wrap=i not in wrap, overflow="fold")
    for i, row in enumerate(rows):
        table.add_row(*(Text(str(c)) for c in row), style=styles[i] if styles else "")
    console.print(table)
    for s in notes:
        console.print(Text(s if s.startswith("*") else f"• {s}"))
