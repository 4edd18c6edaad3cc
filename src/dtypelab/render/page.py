"""One self-contained HTML page from any dtypelab records (bench, audit, trace, lint): tables, charts as inline
SVG, the environment, and the records themselves embedded for download. Nothing on the page loads anything:
no script source, no stylesheet link, no font, no image URL; the download link is a data: URI."""

from __future__ import annotations

import base64
import html
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.records import load_record
from dtypelab.core.results import (
    CATEGORIES,
    CATEGORY_LABELS,
    PEAK_CATEGORIES,
    AuditReport,
    AutopilotReport,
    ForecastReport,
    LintReport,
    Report,
    Tolerance,
    TraceReport,
    TuneReport,
)
from dtypelab.core.results.store import save_text
from dtypelab.core.text import MIB
from dtypelab.render import plots
from dtypelab.render.autopilot import autopilot_doc
from dtypelab.render.bench import bench_notes, bench_title, decision, layer_rows, table_rows, training_sections
from dtypelab.render.distributed import distributed_sections
from dtypelab.render.forecast import SHORT, check_docs, forecast_doc, unit_of
from dtypelab.render.numeric import audit_doc, updates_docs
from dtypelab.render.profile import Section, profile_sections
from dtypelab.render.tables import html_fragment
from dtypelab.render.trace import trace_doc
from dtypelab.render.tune import tune_doc
from dtypelab.render.views import section, section_of

HEATMAP_ROWS = 40  # riskiest tensor families drawn in the audit heat map (the table below lists all)
MAX_HISTOGRAMS = 6
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


def _esc(text: Any) -> str:
    return html.escape(str(text))


def _details(summary: str, body: str, opened: bool = False) -> str:
    """A long table folded away (open in print): the charts above say the same at a glance."""
    return f"<details{' open' if opened else ''}><summary>{_esc(summary)}</summary>{body}</details>"


def _table_section(section: Section) -> str:
    return _details(section.title, html_fragment(section.headers, section.rows, section.notes, classes=True),
                    opened=True)


def _figure(svg: str | None, caption: str, key: str) -> str:
    if svg is None:
        return ""
    return (f"<figure class='plot' id='{key}' data-plot='{key}'><div class='svg'>{svg}</div>"
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


# --- bench -----------------------------------------------------------------------------------------
def _band(base: float, tol: Tolerance, higher: bool) -> tuple[float, float]:
    allowed = tol.allowed(base)
    return (base - allowed, base + abs(base) * 10 + 1) if higher else (base - abs(base) * 10 - 1, base + allowed)


@section(Report)
def _bench(report: Report, key: str, layers: str | None = None) -> str:
    cfg, rec = report.config, decision(report)
    base = report.base
    ran = [r for r in report.results if r.ran]
    names = [r.policy for r in ran]
    timed = [r for r in ran if not (r.info and r.info.numerics_only)]  # an emulated format's time is not its own
    headers, rows = table_rows(report, rec)
    parts = [html_fragment(headers, rows, bench_notes(report, rec), classes=True)]
    parts += map(_table_section, training_sections(report))  # the memory; what an emulated format did per layer
    layers = layer_rows(report)
    if layers:
        parts.append(_details(f"per-layer SQNR, {len(layers[1])} layers", html_fragment(*layers, [], classes=True)))
    parts += map(_table_section, distributed_sections(report))  # --nproc: bytes per step, the scaling estimate
    profiled = [r for r in report.results if r.profile is not None and not r.profile.error]
    if profiled:
        parts.append(_figure(plots.stacked_breakdown(
            [r.policy for r in profiled], [CATEGORY_LABELS[c] for c in CATEGORIES],
            [[r.profile.categories.get(c, 0.0) * 1e3 for c in CATEGORIES] for r in profiled]),
            "Where each policy's step goes (--profile): matmul/conv is what a faster dtype speeds up; casts, other "
            "ops and the time outside any op mostly are not.", f"{key}-profile"))
        parts += map(_table_section, profile_sections(report))
    mb = MIB
    if cfg.mode == "train":
        parts.append(_figure(plots.loss_curves(names, [r.losses for r in ran]),
                             "Loss per step, every policy on the same batches from the same initial weights: a line "
                             "that tracks fp32's learns the same; one that lifts off or stops early diverged.",
                             f"{key}-loss"))
        parts.append(_figure(plots.step_times([r.policy for r in timed], [r.step_times_s[r.warmup:] for r in timed]),
                             "Step-time distribution per policy (box: middle half of the samples, line: median, dots: "
                             "outliers): narrow boxes far apart are a real difference; wide or overlapping ones are "
                             "noise.", f"{key}-times"))
    else:
        parts.append(_figure(plots.step_times([r.policy for r in timed], [r.step_times_s[r.warmup:] for r in timed],
                                              unit="batch"),
                             "Latency distribution per policy (box: middle half, line: median): compare medians, "
                             "and distrust boxes that overlap.", f"{key}-times"))
    base_metric = base.metric(cfg.metric) if base and base.ran else None
    if base_metric is not None and math.isfinite(base_metric):
        # a run that diverged is no candidate, and its metric would squash the candidates into a corner
        stable = [r for r in ran if r.status == "ok" and r.first_nonfinite_step is None]
        points = [(r.policy, (rec.verdict(r.policy).speedup if rec.verdict(r.policy) else None) or math.nan,
                   r.metric(cfg.metric) or math.nan) for r in stable if r.metric(cfg.metric) is not None]
        parts.append(_figure(plots.speed_vs_metric(points, cfg.metric, cfg.higher_is_better,
                                                   _band(base_metric, cfg.tolerance, cfg.higher_is_better), rec.best,
                                                   intervals={r.policy: (r.speedup_ci.low, r.speedup_ci.high)
                                                              for r in stable if r.speedup_ci}),
                             f"Speed against {cfg.metric}: the recommendation is the fastest point inside the green "
                             f"band (within {cfg.tolerance} of fp32); points on the dotted Pareto front are the "
                             "only ones worth considering; a bar through a point is its speedup's 95% interval from "
                             "interleaved rounds. Runs whose loss went non-finite are left out.",
                             f"{key}-pareto"))
    if cfg.mode == "infer":
        points = [(r.policy, (r.timing.median * 1e3) if r.timing else math.nan, r.fidelity.get("cos_min"),
                   r.fidelity.get("sqnr_db")) for r in ran if r.policy != report.baseline]
        parts.append(_figure(plots.latency_vs_fidelity(points, cfg.min_cosine),
                             "Latency against output fidelity vs fp32: left and high is fast and faithful; below the "
                             "dashed line a policy is rejected whatever its metric.", f"{key}-fidelity"))
        sizes = [r.size["file_bytes"] / mb if r.size else (r.model_bytes or 0) / mb or None for r in ran]
        linear = [r.size["linear_weight_bytes"] / mb if r.size else None for r in ran]
        parts.append(_figure(plots.bars(names, [("file MiB", sizes), ("linear-layer weights MiB", linear)]),
                             "Size of the converted model's file, and of its linear-layer weights alone (the part "
                             "quantization shrinks).", f"{key}-size"))
        series = [(r.policy, [x["layer"] for x in r.per_layer], [x["sqnr_db"] for x in r.per_layer],
                   [x["own_sqnr_db"] for x in r.per_layer]) for r in ran if r.per_layer and r.policy != report.baseline]
        parts.append(_figure(plots.layer_sqnr(series),
                             "Per-layer SQNR along the network's depth: where the accumulated line drops, error "
                             "builds up; a dashed dip marks a layer that loses precision on its own (a candidate to "
                             "keep in higher precision).", f"{key}-layers"))
    else:
        memory = [r.peak_memory_bytes / mb if r.peak_memory_bytes is not None else None for r in ran]
        size = [r.model_bytes / mb if r.model_bytes is not None else None for r in ran]
        parts.append(_figure(plots.bars(names, [("peak memory MiB", memory), ("model size MiB", size)]),
                             "Peak memory of each run (above what was in use before the model was built) and the "
                             "size of its weights.", f"{key}-memory"))
        scaled = [(r.policy, r.scaler.get("grad_scale", []), [s["step"] for s in r.scaler.get("skips", [])])
                  for r in ran if r.scaler]
        parts.append(_figure(plots.scaler_history(scaled),
                             "GradScaler's loss scale per step (× = a skipped step): a scale that keeps falling means "
                             "gradients overflow float16 again and again.", f"{key}-scaler"))
    return _section(bench_title(report), "".join(parts), report.environment, report.created, key)


# --- audit -----------------------------------------------------------------------------------------
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
    parts = [_figure(heat, f"The {len(top)} riskiest tensor families against each candidate format, coloured by what "
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
        parts.append(_figure(plots.binade_histogram(f"{layer.name} ({layer.kind}), {why}", layer.stats["binades"],
                                                    bands),
                             "Where this tensor's values sit, per power of two, against each format's subnormal and "
                             "normal range: bars left of a format's range flush to zero, right of it overflow.",
                             f"{key}-binades{i + 1}" if i else f"{key}-binades"))
    parts.append(_details(f"all {len(rows)} tensor families", html_fragment(headers, rows, notes, classes=True),
                          opened=len(rows) <= 25))
    for more_title, more_headers, more_rows, more_notes in updates_docs(report):  # audit --updates
        parts.append(_details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True),
                              opened=True))
    return _section(title, "".join(parts), report.environment, report.created, key)


# --- trace and lint --------------------------------------------------------------------------------
@section(TraceReport)
def _trace(report: TraceReport, key: str, layers: str | None = None) -> str:
    title, _, rows, notes = trace_doc(report)
    card = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in rows)
    body = (f"<table class='card' id='{key}-card'><tbody>{card}</tbody></table>"
            + ("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>" if notes else ""))
    if len(report.losses) > 1:
        body += _figure(plots.loss_curves([report.config.policy], [report.losses]),
                        "Loss up to the stop: a jump just before the first non-finite value points at the step that "
                        "broke it.", f"{key}-loss")
    return _section(title, body, report.environment, report.created, key)


@section(AutopilotReport)
def _autopilot(report: AutopilotReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = autopilot_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    if len(report.losses) > 1:
        body += _figure(plots.loss_curves([report.config.start + " (autopilot)"], [report.losses]),
                        "Loss of the steps that count (rolled-back steps are not in it).", f"{key}-loss")
    return _section(title, body, report.environment, report.created, key)


@section(LintReport)
def _lint(report: LintReport, key: str, layers: str | None = None) -> str:
    rows = [[f.location, f.code, f.rule, f.message, f.fix] for f in report.findings]
    notes = [f"{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''} in {report.files} "
             f"file{'s' if report.files != 1 else ''} ({report.lines:,} lines)"
             + (f", {report.suppressed} suppressed" if report.suppressed else "")]
    return _section("dtypelab lint", html_fragment(["where", "code", "rule", "what", "fix"], rows, notes, classes=True),
                    {}, "", key)


# --- the page --------------------------------------------------------------------------------------
def _section(title: str, body: str, environment: dict[str, Any], created: str, key: str) -> str:
    hw = environment.get("hardware") or {}
    meta = []
    if hw:
        flags = " ".join(hw.get("cpu_flags") or []) or "—"
        meta.append(f"hardware: {_esc(hw.get('device_name') or hw.get('device', ''))} ({_esc(hw.get('device', ''))}), "
                    f"flags {_esc(flags)}, {_esc(hw.get('threads', '?'))} threads")
    if environment.get("torch"):
        meta.append(f"torch {_esc(environment['torch'])}, python {_esc(environment.get('python', '?'))}, dtypelab "
                    f"{_esc(environment.get('dtypelab', '?'))}, {_esc(environment.get('platform', ''))}")
    if environment.get("command"):
        meta.append(f"command: <code>{_esc(environment['command'])}</code>")
    if environment.get("task_settings"):
        meta.append("task settings: " + ", ".join(f"<code>{_esc(k)}={_esc(v)}</code>"
                                                 for k, v in environment["task_settings"].items()))
    if created:
        meta.append(f"recorded {_esc(created)}")
    foot = f"<p class='meta'>{'<br>'.join(meta)}</p>" if meta else ""
    return f"<section class='record' id='{key}'><h2>{_esc(title)}</h2>{body}{foot}</section>"


@section(TuneReport)
def _tune(report: TuneReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = tune_doc(report)
    return _section(title, html_fragment(headers, rows, notes, classes=True), report.environment, report.created, key)


@section(ForecastReport)
def _forecast(report: ForecastReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = forecast_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    scale, unit = unit_of(report)
    drawn = [p for p in report.policies if p.peak is not None]
    parts = [c for c in PEAK_CATEGORIES if any(p.peak.breakdown.get(c) for p in drawn)]
    usable = report.config.device.usable_bytes
    highest = max((p.peak.peak_bytes for p in drawn), default=0)
    near = usable is not None and usable <= 3 * highest  # a line far past the bars would squash them
    chart = plots.stacked_breakdown([p.policy for p in drawn], [SHORT[c] for c in parts],
                                    [[p.peak.breakdown.get(c, 0) / scale for c in parts] for p in drawn],
                                    xlabel=f"{unit} at the peak (training; inference for the inference formats)",
                                    limit=(usable / scale, f"{report.config.device.label}: usable") if near else None)
    where = (f", against the {usable / scale:,.4g} {unit} usable on {report.config.device.label}" if near else
             f" ({report.config.device.label} has {usable / scale:,.4g} {unit} usable)" if usable else "")
    body += _figure(chart, f"What each policy's peak holds, category by category{where}.", f"{key}-forecast")
    for more_title, more_headers, more_rows, more_notes in check_docs(report):
        body += _details(more_title, html_fragment(more_headers, more_rows, more_notes, classes=True), opened=True)
    return _section(title, body, report.environment, report.created, key)


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
        raws.append(f"<li><a class='download' download='{_esc(name)}' href='data:application/json;base64,{data}'>"
                    f"{_esc(name)}</a> ({len(text):,} bytes of JSON)</li>")
    contents = "".join(f"<li><a href='#r{i + 1}'>{_esc(type(r).__name__)}: {_esc(n)}</a></li>"
                       for i, (r, n) in enumerate(zip(records, names, strict=True)))
    made = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{_esc(title)}</h1><p class='meta'>made {made} from {len(records)} record"
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
