"""The report page's HTML parts that every record kind's section uses: its style sheet, escaping, a folded table, a
figure around an inline SVG, and the record's own section with its environment below it."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from dtypelab.render.tables import html_fragment

if TYPE_CHECKING:
    from dtypelab.render.profile import Section

CSS = """
:root{color-scheme:light}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#111;background:#fff;
margin:0 auto;max-width:1100px;padding:1.2em 1.5em;line-height:1.45}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.2em;margin:1.6em 0 .4em;border-bottom:2px solid #0072B2}
h3{font-size:1em;margin:1.2em 0 .3em}
figure{margin:1em 0;break-inside:avoid}figure .svg svg{max-width:100%;height:auto}
figcaption{font-size:.9em;color:#333;margin-top:.2em}
table{border-collapse:collapse;font-size:.82em;margin:.5em 0;display:block;overflow-x:auto}
td,th{border:1px solid #bbb;padding:3px 7px;text-align:left}th{background:#f0f4f8}
td.n{text-align:right}td.t{min-width:5em}td.t:first-child{white-space:nowrap}
th{font-weight:600;vertical-align:bottom}td{overflow-wrap:normal;word-break:keep-all}
summary{cursor:pointer;font-size:.9em;color:#0072B2;margin:.4em 0}
ul{font-size:.9em}.card td{white-space:normal;text-align:left}.card td:first-child{font-weight:600;width:9em}
.meta{font-size:.85em;color:#333}.meta code{background:#f4f4f4;padding:0 .3em}
section.record{margin-bottom:2.5em}
@media print{body{max-width:none;padding:0}h2{break-after:avoid}table{display:table;overflow:visible}
a.download{display:none}details>*{display:block}}
"""



def esc(text: Any) -> str:
    return html.escape(str(text))


def details(summary: str, body: str, opened: bool = False) -> str:
    """A long table folded away (open in print): the charts above say the same at a glance."""
    return f"<details{' open' if opened else ''}><summary>{esc(summary)}</summary>{body}</details>"


def table_section(section: Section) -> str:
    return details(section.title, html_fragment(section.headers, section.rows, section.notes, classes=True),
                    opened=True)


def figure(svg: str | None, caption: str, key: str) -> str:
    if svg is None:
        return ""
    return (f"<figure class='plot' id='{key}' data-plot='{key}'><div class='svg'>{svg}</div>"
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def record_section(title: str, body: str, environment: dict[str, Any], created: str, key: str) -> str:
    hw = environment.get("hardware") or {}
    meta = []
    if hw:
        flags = " ".join(hw.get("cpu_flags") or []) or "—"
        meta.append(f"hardware: {esc(hw.get('device_name') or hw.get('device', ''))} ({esc(hw.get('device', ''))}), "
                    f"flags {esc(flags)}, {esc(hw.get('threads', '?'))} threads")
    if environment.get("torch"):
        meta.append(f"torch {esc(environment['torch'])}, python {esc(environment.get('python', '?'))}, dtypelab "
                    f"{esc(environment.get('dtypelab', '?'))}, {esc(environment.get('platform', ''))}")
    if environment.get("command"):
        meta.append(f"command: <code>{esc(environment['command'])}</code>")
    if environment.get("task_settings"):
        meta.append("task settings: " + ", ".join(f"<code>{esc(k)}={esc(v)}</code>"
                                                 for k, v in environment["task_settings"].items()))
    if created:
        meta.append(f"recorded {esc(created)}")
    foot = f"<p class='meta'>{'<br>'.join(meta)}</p>" if meta else ""
    return f"<section class='record' id='{key}'><h2>{esc(title)}</h2>{body}{foot}</section>"
