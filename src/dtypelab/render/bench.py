"""Renderers: terminal table, Markdown, HTML and JSON. They read Report records only: the decision, each policy's
verdict and speedup, and the notes are in the record (``report.recommendation``)."""

from __future__ import annotations

from dtypelab.core.errors import DtypelabError
from dtypelab.core.objectives import objective
from dtypelab.core.results import (
    COUNTED,
    MEMORY_LABELS,
    PER_LAYER_SAMPLES,
    MemoryBreakdown,
    PolicyResult,
    PolicyVerdict,
    Recommendation,
    Report,
)
from dtypelab.core.text import KIB, MIB, num, pct
from dtypelab.render.distributed import distributed_sections
from dtypelab.render.profile import Section, profile_sections
from dtypelab.render.tables import drop_order, html_table, markdown_table, rich_table

FORMATS = ("table", "markdown", "html", "json")
MB = MIB  # every memory and size column: MiB (2^20 bytes), as torch and nvidia-smi report
# Columns a narrow terminal leaves out first to last (the notes still say what they held); the policy, its speedup,
# metric, worst cosine and verdict stay.
DROP_FIRST = ("samples/s", "J/sample", "size MiB", "linear W", "max abs err", "train MiB", "peak MiB", "step ms",
              "latency ms", "final loss", "SQNR dB", "status", "Δ ")


def _drop_first(report: Report) -> tuple[str, ...]:
    """The columns a narrow terminal leaves out, in order; chosen for energy, the joules stay as the speedup does."""
    return tuple(c for c in DROP_FIRST if c != "J/sample") if objective(report.config.objective).counts_joules \
        else DROP_FIRST


def _numerics_only(r: PolicyResult) -> bool:
    return bool(r.info and r.info.numerics_only)


def _timing(r: PolicyResult) -> str:
    if _numerics_only(r):
        return "emulated"  # its steps' time is the emulation's, not the format's
    t = r.timing
    if t is None:
        return "—"
    text = f"{t.median * 1e3:.3g} ± {t.iqr * 1e3:.2g}"
    return text + " *" if t.noisy else text  # footnoted below the table


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "—"


def _size(r: PolicyResult, base: PolicyResult | None) -> str:
    if r.model_bytes is None:
        return "—"
    mb = num(r.model_bytes / MB, ".1f")
    ratio = _ratio(r.model_bytes, base.model_bytes if base else None)
    return mb if (base is not None and r.policy == base.policy) or ratio == "—" else f"{mb} ({ratio})"


def _linear_bytes(r: PolicyResult) -> float | None:
    return r.size["linear_weight_bytes"] if r.size else None


def _emulated(r: PolicyResult) -> bool:
    return bool(r.info and r.info.emulated)


def _speed(v: PolicyVerdict | None, r: PolicyResult) -> str:
    if v is None or not v.speedup:
        return "—"
    mark = " †" if _emulated(r) else ""  # emulated format: never read as native speed
    if v.speedup_low is not None and v.speedup_high is not None:
        return f"{v.speedup:.2f}x ({v.speedup_low:.2f}–{v.speedup_high:.2f}){mark}"
    return f"{v.speedup:.2f}x{mark}"


def _joules(r: PolicyResult) -> str:
    """Joules per sample, ± the half-interval over the windows where there were several."""
    e = r.energy
    if e is None:
        return "—"
    if e.low is None or e.high is None:
        return f"{e.joules_per_sample:.3g}"
    half = (e.high - e.low) / 2 / (e.joules_per_step / e.joules_per_sample)
    return f"{e.joules_per_sample:.3g} ± {half:.2g}"


def decision(report: Report) -> Recommendation:
    """The record's decision (every record dtypelab writes or loads carries one)."""
    if report.recommendation is None:
        raise DtypelabError("this report carries no recommendation: judge it first (dtypelab.core.judging.judged) "
                            "or load it with dtypelab.load_report")
    return report.recommendation


def table_rows(report: Report, rec: Recommendation) -> tuple[list[str], list[list[str]]]:
    """Headers and cell texts shared by every renderer."""
    cfg = report.config
    metric = cfg.metric + (" ↑" if cfg.higher_is_better else " ↓")
    base = report.base
    infer = cfg.mode == "infer"
    cosine = infer and any("cos_min" in r.fidelity for r in report.results)
    linear = infer and any(_linear_bytes(r) for r in report.results)
    paired = any(v.speedup_low is not None for v in rec.policies)
    headers = ["policy", "status", "latency ms (median ± IQR)" if infer else "step ms (median ± IQR)",
               "speedup (95% interval)" if paired else "speedup", "samples/s", "peak MiB", "size MiB"]
    energy = any(r.energy for r in report.results)
    headers[5:5] = ["J/sample"] if energy else []
    counted = not infer and any(r.memory for r in report.results)
    at = 7 if energy else 6  # train MiB after peak MiB, wherever J/sample put it
    headers[at:at] = ["train MiB"] if counted else []
    headers += (["linear W"] if linear else []) + (["SQNR dB", "max abs err"] if infer else ["final loss"])
    headers += (["worst cos"] if cosine else []) + [metric, f"Δ {cfg.metric}", "verdict"]
    rows = []
    for r in report.results:
        v = rec.verdict(r.policy)
        row = [r.policy, r.status, _timing(r), _speed(v, r) if r.ran else "—",
               num(None if _numerics_only(r) else r.throughput, ",.0f"),
               num(r.peak_memory_bytes / MB if r.peak_memory_bytes is not None else None, ".1f"), _size(r, base)]
        row[5:5] = [_joules(r)] if energy else []
        if counted:
            total = r.memory["total"] if r.memory else None
            row[at:at] = [num(total / MB, ".1f" if total >= MB else ".2g") if total is not None else "—"]
        if linear:
            row.append(_ratio(_linear_bytes(r), _linear_bytes(base) if base else None) if r.ran else "—")
        if infer:
            row += [num(r.fidelity.get("sqnr_db"), ".1f"), num(r.fidelity.get("max_abs_err"), ".3g")]
        else:
            row += [num(r.final_loss, "#.4g")]
        if cosine:
            row.append(num(r.fidelity.get("cos_min"), ".4f"))
        row += [num(r.metric(cfg.metric)), (v.delta if v else "") or "—", v.text if v else ""]
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
    settings = report.environment.get("task_settings") or {}
    task = cfg.task_name or cfg.task
    if settings:  # a built-in task changed by a variable (a float16 copy of minilm's weights, say)
        task += f" (with {', '.join(settings)})"
    return (f"dtypelab {what}: {task}{script} · {steps}{batch} · "
            f"{hw.get('device_name') or cfg.device} · torch {report.environment.get('torch', '?')}")


def bench_notes(report: Report, rec: Recommendation) -> list[str]:
    """The sentences under the table: the decision and its explanation, then the footnotes."""
    return [*rec.sentences, *rec.notes]


LAYER_TITLE = (f"per-layer SQNR dB vs fp32: accumulated / this layer alone (first {PER_LAYER_SAMPLES} samples of "
               "the batch)")
LAYER_NOTE = ("accumulated: the layer's output with every earlier layer converted too; alone: the converted "
              "layer fed fp32's input. inf: identical to fp32 (a layer the policy leaves alone).")


def layer_rows(report: Report) -> tuple[list[str], list[list[str]]] | None:
    """The --per-layer table: one row per layer, one column per policy; None when it was not measured."""
    per = {r.policy: {row["layer"]: row for row in r.per_layer}
           for r in report.results if r.policy != report.baseline and r.per_layer}
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


MEMORY_TITLE = "where the training memory goes ({unit}, counted from the tensors after the run)"
MEMORY_NOTE = ("weights, gradients, optimizer state and master copy (a float32 copy, Kahan's compensation) as their "
               "tensors hold them (a quantized state by its inner tensors); activations: what one forward pass of a "
               "training batch keeps for the backward; the train column adds them up; process peak: the run's "
               "measured peak above the memory in use before the model was built.")
# bench's table spells two of the short names out (it has room: no buffers, no temporaries)
_SPELLED = {**MEMORY_LABELS, "frozen_weights": "frozen base", "optimizer_state": "optimizer state",
            "master_weights": "master copy"}
MEMORY_COLUMNS = tuple((_SPELLED[c], c) for c in COUNTED)
FROZEN_NOTE = ("frozen base: the weights that do not train (a quantized base by its inner tensors); weights: those "
               "that do (the adapters, a new head).")
PART = "part:"  # a column key: a part of the activations a kind counted apart, by its label


def memory_parts(report: Report) -> dict[str, str]:
    """The parts of the activations the runs' kinds counted apart (``MemoryBreakdown.parts``), label: note, in the
    order met: drawn as they come, whatever kind named them."""
    return {p["label"]: p["note"] for r in report.results if r.memory for p in r.memory.get("parts", ())}


def memory_columns(report: Report) -> list[tuple[str, str]]:
    """The breakdown's columns: the frozen base where some run has one, each part some run counted, the total."""
    counted = [r.memory for r in report.results if r.memory]
    fixed = [(h, k) for h, k in MEMORY_COLUMNS if k != "frozen_weights" or any(m.get(k) for m in counted)]
    return [*fixed, *((label, PART + label) for label in memory_parts(report)), ("train MiB", "total")]


def memory_value(memory: MemoryBreakdown, key: str) -> int | None:
    """A column's bytes in one run's breakdown (a part it did not count: None)."""
    if key.startswith(PART):
        return next((p["bytes"] for p in memory.get("parts", ()) if p["label"] == key[len(PART):]), None)
    value = memory.get(key)
    return value if isinstance(value, int) else None


def memory_unit(report: Report) -> tuple[str, int]:
    """KiB for a model whose whole training state is under a MiB (a toy), else MiB."""
    totals = [r.memory.get("total") or 0 for r in report.results if r.memory]
    return ("KiB", KIB) if totals and max(totals) < MB else ("MiB", MB)


def memory_rows(report: Report) -> tuple[list[str], list[list[str]]] | None:
    """The memory breakdown table: one row per trained policy, its state beside fp32's; None when not counted."""
    counted = [r for r in report.results if r.memory]
    if not counted:
        return None
    base = report.base
    base_mem = base.memory if base is not None else None
    unit, scale = memory_unit(report)
    columns = memory_columns(report)
    headers = ["policy", *(c if c != "train MiB" else f"train {unit}" for c, _ in columns), "process peak MiB"]
    rows = []
    for r in counted:
        cells = []
        for _, key in columns:
            value = memory_value(r.memory, key)
            cell = num(value / scale if value is not None else None, ".2f")
            ref = memory_value(base_mem, key) if base_mem and r is not base else None
            cells.append(f"{cell} ({value / ref:.2f}x)" if value is not None and ref else cell)
        peak = r.peak_memory_bytes
        rows.append([r.policy, *cells, num(peak / MB if peak is not None else None, ".1f")])
    return headers, rows


def memory_sections(report: Report) -> list[Section]:
    """The training memory's table, when it was counted."""
    memory = memory_rows(report)
    title = MEMORY_TITLE.format(unit=memory_unit(report)[0])
    # a narrow terminal keeps the policy, its optimizer state and its total longest
    drop = ("process peak", "gradients", "master copy", "activations", "weights")
    shown = {key for _, key in memory_columns(report)}
    notes = [MEMORY_NOTE, *([FROZEN_NOTE] if "frozen_weights" in shown else []),
             *(f"{label}: {note}." for label, note in memory_parts(report).items())]
    return [Section(title, *memory, notes, left={0}, wrap={0}, drop=drop)] if memory else []


EMULATED_TITLE = "emulated layers: each converted layer on one training batch (numerics only)"
EMULATED_NOTE = ("SQNR dB: the layer's emulated output against the bfloat16 matmul of the same input and weight, the "
                 "median over rows (tokens) of each row's; "
                 "flushed: the share of the input's and the weight's non-zero values that are zero in float8 with the "
                 "recipe's scales (one per tensor, or per row). The layers are those the recipe's filter converts on a "
                 "GPU.")


def emulated_sections(report: Report) -> list[Section]:
    """Per emulated policy, what its format did to each layer it converted; none when no policy was emulated."""
    rows = [[r.policy, e["layer"], e["shape"], num(e["sqnr_db"], ".1f"), pct(e["input_underflow"]),
             pct(e["weight_underflow"])] for r in report.results for e in r.emulated_layers]
    if not rows:
        return []
    headers = ["policy", "layer", "shape", "SQNR dB vs bf16", "input flushed", "weight flushed"]
    return [Section(EMULATED_TITLE, headers, rows, [EMULATED_NOTE], left={0, 1, 2}, wrap={1})]


def training_sections(report: Report) -> list[Section]:
    """Where the training memory goes, and what an emulated format did to each layer it converted."""
    return memory_sections(report) + emulated_sections(report)


def sections(report: Report) -> list[Section]:
    """The tables under the main one: the training memory, emulated layers, --per-layer, then --profile's."""
    first = training_sections(report)
    layers = layer_rows(report)
    first += [Section(LAYER_TITLE, *layers, [LAYER_NOTE], left={0, 1}, wrap={0})] if layers else []
    return first + distributed_sections(report) + profile_sections(report)


def render_markdown(report: Report) -> str:
    rec = decision(report)
    headers, rows = table_rows(report, rec)
    text = markdown_table(bench_title(report), headers, rows, bench_notes(report, rec))
    return text + "".join("\n" + markdown_table(x.title, x.headers, x.rows, x.notes) for x in sections(report))


def render_html(report: Report) -> str:
    rec = decision(report)
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
    rec = decision(report)
    headers, rows = table_rows(report, rec)
    colours = {"ok": "", "diverged": "red", "failed": "red", "timeout": "red", "oom": "red",
               "skipped": "dim", "interrupted": "yellow"}
    styles = ["bold green" if r.policy == rec.best else colours.get(r.status, "") for r in report.results]
    last = len(headers) - 1  # the verdict column gives way instead of the numbers
    rich_table(console, bench_title(report), headers, rows, bench_notes(report, rec), left={0, 1, last}, wrap={last},
               styles=styles, drop=drop_order(headers, _drop_first(report)))
    for x in sections(report):
        rich_table(console, x.title, x.headers, x.rows, x.notes, left=x.left, wrap=x.wrap,
                   drop=drop_order(x.headers, x.drop) if x.drop else None)


def render(report: Report, fmt: str) -> str:
    """Text of the report in a non-terminal format."""
    return {"markdown": render_markdown, "html": render_html, "json": render_json}[fmt](report)
