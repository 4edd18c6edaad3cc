"""Table building blocks every renderer shares: number formatting, Markdown, HTML and rich tables."""

from __future__ import annotations

import html
import re


def markdown_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    def cells(row: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

    lines = [f"**{title}**", "", cells(headers), "|" + "|".join("---" for _ in headers) + "|"]
    lines += [cells(row) for row in rows]
    lines += [""] + [f"- {s}" for s in notes] if notes else []
    return "\n".join(lines) + "\n"


NUMERIC = re.compile(r"^[-+−]?(\d[\d,]*\.?\d*(e[-+]?\d+)?|inf|nan|—)( ?(x|%|KiB|MiB|GiB|ms|dB|s))?( [±(].*)?( [*†])?$",
                     re.I)


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
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse;display:block;"
        "overflow-x:auto;max-width:100%}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child"
        "{text-align:left}</style></head><body>"
        f"<h2>{html.escape(title)}</h2>{html_fragment(headers, rows, notes)}</body></html>\n"
    )


WORD_CAP = 32  # a wrapping column is never narrower than its longest word, up to this many characters
COMFORT = 24  # wrapping columns get this much room before numbers' headers are unfolded


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def fit_columns(headers: list[str], rows: list[list[str]], width: int, wrap: set[int] | frozenset[int] = frozenset(),
                drop: list[int] | tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    """Which columns a table keeps at ``width`` characters, and their widths, so that every line fits and no word
    is cut: numbers never wrap; headers and the ``wrap`` columns wrap between words (never below their longest
    word, up to WORD_CAP); while even that is too wide, the columns in ``drop`` go first to last. A table that
    cannot fit with every droppable column gone keeps its narrowest layout (rich then folds what remains)."""
    n = len(headers)
    cells = [[str(r[i]) for r in rows] for i in range(n)]
    natural = [max([len(headers[i]), *map(len, cells[i])]) for i in range(n)]
    body = [max((min(_longest_word(c), WORD_CAP) for c in cells[i]), default=0) if i in wrap
            else max(map(len, cells[i]), default=0) for i in range(n)]
    minimum = [max(1, body[i], min(_longest_word(headers[i]), WORD_CAP)) for i in range(n)]
    kept, queue = list(range(n)), [i for i in drop if 0 <= i < n]

    def total(cols: list[int], widths: dict[int, int]) -> int:
        return sum(widths[i] for i in cols) + 3 * len(cols) + 1  # "│ " + cell + " " per column, and the last "│"

    while total(kept, dict(enumerate(minimum))) > width and queue:
        kept.remove(queue.pop(0))
    widths = {i: minimum[i] for i in kept}
    spare = width - total(kept, widths)
    for cols, cap in (([i for i in kept if i in wrap], lambda i: min(natural[i], max(minimum[i], COMFORT))),
                      ([i for i in kept if i not in wrap], lambda i: natural[i]),
                      ([i for i in kept if i in wrap], lambda i: natural[i])):
        for i in cols:
            add = max(0, min(spare, cap(i) - widths[i]))
            widths[i] += add
            spare -= add
    return kept, [widths[i] for i in kept]


def drop_order(headers: list[str], names: list[str] | tuple[str, ...]) -> list[int]:
    """Column indices for ``fit_columns``'s ``drop``, from header prefixes in the order the columns may go."""
    out = []
    for name in names:
        out += [i for i, h in enumerate(headers) if h.startswith(name) and i not in out]
    return out


def rich_table(console: object, title: str, headers: list[str], rows: list[list[str]], notes: list[str],
               left: set[int] = frozenset({0}), wrap: set[int] = frozenset(), styles: list[str] | None = None,
               drop: list[int] | tuple[int, ...] | None = None) -> None:
    """Print with rich at the console's width: numbers right-aligned and never wrapped, text columns and headers
    wrapped between words, and, where even that is too wide, the columns of ``drop`` left out first to last (by
    default every column but the first and the wrapping ones, right to left), named in a note below the table.

    Every string is passed as ``Text``, never as markup: cells hold user code (``torch.cat([x, y])``), layer
    names (``blocks[0]``) and reasons, which rich would otherwise parse as ``[style]`` tags and drop."""
    from rich.table import Table
    from rich.text import Text

    if drop is None:
        drop = [i for i in range(len(headers) - 1, 0, -1) if i not in wrap]
    kept, widths = fit_columns(headers, rows, console.width, wrap, drop)
    console.print(Text(title))  # above the table, wrapped between words: a long title never widens the table
    table = Table()
    for i, w in zip(kept, widths, strict=True):
        table.add_column(Text(headers[i], no_wrap=False), justify="left" if i in left else "right", width=w,
                         no_wrap=i not in wrap, overflow="fold")
    for k, row in enumerate(rows):
        table.add_row(*(Text(str(row[i])) for i in kept), style=styles[k] if styles else "")
    console.print(table)
    gone = [headers[i] for i in range(len(headers)) if i not in kept]
    if gone:
        console.print(Text(f"• left out to fit {console.width} columns: {', '.join(gone)} (a wider terminal, "
                           "COLUMNS=200, or --format markdown / json shows every column)"))
    for s in notes:
        console.print(Text(s if s.startswith("*") else f"• {s}"))


def plus_minus(error: float) -> str:
    """A header's band: the error the validation set's held-out cases support for that column (docs/validation.md)."""
    return f" ±{error:.0%}" if error else ""
