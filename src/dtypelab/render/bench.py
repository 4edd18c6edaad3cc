"""Renderers: terminal table, Markdown, HTML and JSON. They only read Report records."""

from __future__ import annotations

import math

from dtypelab.bench.recommend import Recommendation, Tolerance, delta_text, recommend, speedup
from dtypelab.core.hardware import HardwareInfo
from dtypelab.core.policies import BASELINE, COMPILED_BASELINE
from dtypelab.core.results import PolicyResult, Report
from dtypelab.inference.perlayer import SAMPLES
from dtypelab.render.distributed import distributed_sections
from dtypelab.render.profile import Section, profile_sections
from dtypelab.render.tables import drop_order, html_table, markdown_table, num, rich_table

FORMATS = ("table", "markdown", "html", "json")
MB = 2**20
# Columns a narrow terminal leaves out first to last (the notes still say what they held); the policy, its speedup,
# metric, worst cosine and verdict stay.
DROP_FIRST = ("samples/s", "size MB", "linear W", "max abs err", "peak MB", "step ms", "latency ms", "final loss",
              "SQNR dB", "status", "Δ ")


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


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "—"


def _size(r: PolicyResult, base: PolicyResult | None) -> str:
    if r.model_bytes is None:
        return "—"
    mb = num(r.model_bytes / MB, ".1f")
    ratio = _ratio(r.model_bytes, base.model_bytes if base else None)
    return mb if r.policy == BASELINE or ratio == "—" else f"{mb} ({ratio})"


def _linear_bytes(r: PolicyResult) -> float | None:
    return r.size["linear_weight_bytes"] if r.size else None


def _emulated(r: PolicyResult) -> bool:
    return bool(r.info and r.info.emulated)


def table_rows(report: Report, rec: Recommendation) -> tuple[list[str], list[list[str]]]:
    """Headers and cell texts shared by every renderer."""
    cfg = report.config
    metric = cfg.metric + (" ↑" if cfg.higher_is_better else " ↓")
    base = report.result(BASELINE)
    tol = Tolerance.parse(cfg.tolerance)
    infer = cfg.mode == "infer"
    cosine = infer and any("cos_min" in r.fidelity for r in report.results)
    linear = infer and any(_linear_bytes(r) for r in report.results)
    paired = any(r.speedup_ci for r in report.results)
    headers = ["policy", "status", "latency ms (median ± IQR)" if infer else "step ms (median ± IQR)",
               "speedup (95% interval)" if paired else "speedup", "samples/s", "peak MB", "size MB"]
    headers += (["linear W"] if linear else []) + (["SQNR dB", "max abs err"] if infer else ["final loss"])
    headers += (["worst cos"] if cosine else []) + [metric, f"Δ {cfg.metric}", "verdict"]
    rows = []
    for r in report.results:
        sp = speedup(r, base) if base and r.ran else None
        mark = " †" if sp and _emulated(r) else ""  # emulated format: never read as native speed
        ci = r.speedup_ci
        speed = f"{sp:.2f}x ({ci.low:.2f}–{ci.high:.2f}){mark}" if sp and ci else (f"{sp:.2f}x{mark}" if sp else "—")
        row = [r.policy, r.status, _timing(r), speed, num(r.throughput, ",.0f"),
               num(r.peak_memory_bytes / MB if r.peak_memory_bytes is not None else None, ".1f"), _size(r, base)]
        if linear:
            row.append(_ratio(_linear_bytes(r), _linear_bytes(base) if base else None) if r.ran else "—")
        if infer:
            row += [num(r.fidelity.get("sqnr_db"), ".1f"), num(r.fidelity.get("max_abs_err"), ".3g")]
        else:
            row += [num(r.final_loss, "#.4g")]
        if cosine:
            row.append(num(r.fidelity.get("cos_min"), ".4f"))
        row += [num(r.metric(cfg.metric)), _delta(r, base, cfg.metric, tol), rec.verdicts.get(r.policy, "")]
        rows.append(row)
    return headers, rows


def bench_title(report: Report) -> str:
    cfg, hw = report.config, report.environment.get("hardware", {})
    what = "inference" if cfg.mode == "infer" else "training"
    steps = f"≤{cfg.steps} steps (or {cfg.time_box_s:g} s)" if cfg.time_box_s else f"{cfg.steps} steps"
    batch = f" × batch {cfg.batch_size}" if cfg.batch_size else ""
    script = f" -- {' '.join(cfg.script_args)}" if cfg.script_args else ""
    if cfg.nproc:
        batch += f" · {cfg.nproc * cfg.nnodes} ranks (torchrun)"
    return (f"dtypelab {what}: {cfg.task_name or cfg.task}{script} · {steps}{batch} · "
            f"{hw.get('device_name') or cfg.device} · torch {report.environment.get('torch', '?')}")


def _compiled_text(r: PolicyResult, report: Report) -> str:
    """A compiled policy against compiled fp32, its fair baseline (compilation alone speeds fp32 up too)."""
    base = report.result(COMPILED_BASELINE)
    if r.policy == COMPILED_BASELINE or not (r.info and r.info.compiles) or not r.ran or not base or not base.ran:
        return ""
    ci = r.compiled_ci
    if ci:
        how = f"{ci.point:.2f}x ({ci.low:.2f}–{ci.high:.2f}, paired rounds)"
    elif r.timing and base.timing:
        how = f"{base.timing.median / r.timing.median:.2f}x (medians)"
    else:
        return ""
    return (f"{r.policy} vs {COMPILED_BASELINE}, its fair baseline (compiling speeds fp32 up too): {how}; "
            "the speedup column is vs eager fp32.")


def bench_notes(report: Report, rec: Recommendation) -> list[str]:
    notes = list(rec.sentences)
    ran = [r for r in report.results if r.ran]
    hw = report.environment.get("hardware")
    hw = HardwareInfo.from_dict(hw) if hw else None
    for r in ran:
        info = r.info
        if info and info.arithmetic:
            notes.append(f"{r.policy} ({info.backend}): {info.arithmetic}.")
        if info and info.compute_dtype == "int8" and hw and hw.native("int8") is False:
            notes.append(f"{r.policy}: this {hw.device_name or 'device'} has no int8 dot-product instructions "
                         "(VNNI/AMX), so its int8 matmuls are not native here.")
        fair = _compiled_text(r, report)
        if fair:
            notes.append(fair)
        first = r.first_call_s
        if info and info.compiles and first:
            notes.append(f"{r.policy}: the first call took {first:.1f} s (compilation, which inductor caches on "
                         "disk for later runs), outside the latency.")
    if any(_emulated(r) for r in ran):
        notes.append("† emulated format: stored in it but computed in a wider type; its speed is not the "
                     "format's native speed.")
    if any(_linear_bytes(r) for r in ran):
        notes.append("size MB: the converted model's file (safetensors, or torch.save for torch.ao's packed "
                     "modules); linear W: bytes of linear-layer weights incl. scales, vs fp32.")
    cfg = report.config
    if any(r.speedup_ci for r in report.results):
        notes.append(f"speedup: geometric mean of fp32's block median over the policy's, over {cfg.rounds} "
                     f"interleaved rounds of {cfg.rounds_block} steps in one process (paired: the same round, the "
                     "same batches), with a 95% Student-t interval; step ms is from each policy's own run.")
    if any(r.timing and r.timing.noisy for r in report.results):
        notes.append("* noisy timing: IQR above 10% of the median; compare such policies with care.")
    return notes


LAYER_TITLE = f"per-layer SQNR dB vs fp32: accumulated / this layer alone (first {SAMPLES} samples of the batch)"
LAYER_NOTE = ("accumulated: the layer's output with every earlier layer converted too; alone: the converted "
              "layer fed fp32's input. inf: identical to fp32 (a layer the policy leaves alone).")


def layer_rows(report: Report) -> tuple[list[str], list[list[str]]] | None:
    """The --per-layer table: one row per layer, one column per policy; None when it was not measured."""
    per = {r.policy: {row["layer"]: row for row in r.per_layer}
           for r in report.results if r.policy != BASELINE and r.per_layer}
    if not per:
        return None
    layers: dict[str, str] = {}
    for table in per.values():
        for name, row in table.items():
            layers.setdefault(name, row["type"])
    headers = ["layer", "type", *per]
    rows = []
    for name, kind in layers.items():
        cells = []
        for table in per.values():
            row = table.get(name)
            cells.append(f"{num(row['sqnr_db'], '.1f')} / {num(row['own_sqnr_db'], '.1f')}" if row else "—")
        rows.append([name, kind, *cells])
    return headers, rows


def sections(report: Report) -> list[Section]:
    """The tables under the main one: --per-layer, then --profile's."""
    layers = layer_rows(report)
    first = [Section(LAYER_TITLE, *layers, [LAYER_NOTE], left={0, 1}, wrap={0})] if layers else []
    return first + distributed_sections(report) + profile_sections(report)


def render_markdown(report: Report) -> str:
    rec = recommend(report)
    headers, rows = table_rows(report, rec)
    text = markdown_table(bench_title(report), headers, rows, bench_notes(report, rec))
    return text + "".join("\n" + markdown_table(x.title, x.headers, x.rows, x.notes) for x in sections(report))


def render_html(report: Report) -> str:
    rec = recommend(report)
    headers, rows = table_rows(report, rec)
    page = html_table(bench_title(report), headers, rows, bench_notes(report, rec))
    for x in sections(report):  # more tables inside the same page
        more = html_table(x.title, x.headers, x.rows, x.notes)
        page = page.replace("</body>", more[more.index("<h2>"):more.index("</body>")] + "</body>")
    return page


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
    rich_table(console, bench_title(report), headers, rows, bench_notes(report, rec), left={0, 1, last}, wrap={last},
               styles=styles, drop=drop_order(headers, DROP_FIRST))
    for x in sections(report):
        rich_table(console, x.title, x.headers, x.rows, x.notes, left=x.left, wrap=x.wrap,
                   drop=drop_order(x.headers, x.drop) if x.drop else None)


def render(report: Report, fmt: str) -> str:
    """Text of the report in a non-terminal format."""
    return {"markdown": render_markdown, "html": render_html, "json": render_json}[fmt](report)
