"""One self-contained HTML page from any dtypelab records (bench, audit, trace, lint): tables, charts as inline
SVG, the environment, and the records themselves embedded for download. Nothing on the page loads anything:
no script source, no stylesheet link, no font, no image URL; the download link is a data: URI."""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.records import load_record
from dtypelab.core.results.store import save_text
from dtypelab.render.drawing import section_of
from dtypelab.render.html import CSS, esc


def _render(record: Any, key: str, layers: str | None) -> str:
    return section_of(record)(record, key, layers)


def report_html(records: Sequence[Any], names: Sequence[str] | None = None, title: str = "dtypelab report",
                layers: str | None = None) -> str:
    """The page for ``records`` (bench ``Report``, ``AuditReport``, ``TraceReport``, ``LintReport``); ``names``:
    their file names, for the download links; ``layers``: a regular expression choosing the audit's tensor
    families drawn as binade histograms (default: the riskiest of each kind)."""
    names = list(names or [f"record-{i + 1}.json" for i in range(len(records))])
    sections = "".join(_render(r, f"r{i + 1}", layers) for i, r in enumerate(records))
    raws = []
    for record, name in zip(records, names, strict=True):  # once, as a data: URI: a download, not a request
        text = record.to_json()
        data = base64.b64encode(text.encode()).decode()
        raws.append(f"<li><a class='download' download='{esc(name)}' href='data:application/json;base64,{data}'>"
                    f"{esc(name)}</a> ({len(text):,} bytes of JSON)</li>")
    contents = "".join(f"<li><a href='#r{i + 1}'>{esc(type(r).__name__)}: {esc(n)}</a></li>"
                       for i, (r, n) in enumerate(zip(records, names, strict=True)))
    made = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{esc(title)}</h1><p class='meta'>made {made} from {len(records)} record"
            f"{'s' if len(records) != 1 else ''}</p><ul>{contents}</ul>{sections}"
            f"<h2>Raw records</h2><p class='meta'>The records this page was drawn from, as written; "
            f"<code>dtypelab show FILE</code> renders them again.</p><ul>{''.join(raws)}</ul></body></html>\n")


@dataclass(frozen=True)
class ReportInfo:
    path: str | None
    html: str
    records: int
    plots: int

    @property
    def bytes(self) -> int:
        return len(self.html.encode())


def report(records: Sequence[str | Any], path: str | None = None, title: str = "dtypelab report",
           layers: str | None = None) -> ReportInfo:
    """One offline HTML page from result files (``dtypelab-results/*.json``) or records in memory; written to
    ``path`` (atomically) when given. ``layers``: see ``report_html``."""
    if not records:
        raise DtypelabError("no records given: name result files written by dtypelab bench, audit, trace or lint")
    if layers:
        try:
            re.compile(layers)
        except re.error as exc:
            raise DtypelabError(f"--layer {layers!r} is not a valid regular expression: {exc}") from None
    loaded, names = [], []
    for i, item in enumerate(records):
        if isinstance(item, str | os.PathLike):
            loaded.append(load_record(os.fspath(item)))
            names.append(os.path.basename(os.fspath(item)))
        else:
            loaded.append(item)
            names.append(f"{getattr(item, 'schema', 'record').replace('.', '-')}-{i + 1}.json")
    text = report_html(loaded, names, title, layers)
    if path:
        save_text(path, text)
    return ReportInfo(path, text, len(loaded), text.count("data-plot="))
