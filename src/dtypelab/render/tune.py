"""The tune record as a table: each layer's measurements and verdict, then the plan against the uniform ones."""

from __future__ import annotations

from dtypelab.core.results import PlanEvaluation, TuneReport
from dtypelab.render.html import record_section
from dtypelab.render.tables import html_fragment
from dtypelab.render.views import document, section


@document(TuneReport, wrap={5})
def tune_doc(report: TuneReport) -> tuple[str, list[str], list[list[str]], list[str]]:
    cfg = report.config
    train = cfg.mode == "train"
    if train:
        constraint = f"{cfg.metric} within {cfg.tolerance or '?'} of fp32's" + (
            f" {cfg.base_metric:.4g}" if cfg.base_metric else "")
        title = f"dtypelab tune: {cfg.task_name or cfg.task} · training ({cfg.steps} steps) · {constraint}"
        headers = ["layer", "candidate", "loss deviation alone", "gain µs/step", "converted", "why"]
    else:
        title = f"dtypelab tune: {cfg.task_name or cfg.task} · inference · worst cosine ≥ {cfg.min_cosine:g}"
        headers = ["layer", "candidate", "1 − cosine alone", "gain µs/call", "chosen", "why"]
    rows = [[layer.name, layer.candidate, f"{layer.sensitivity:.2e}", f"{layer.gain_s * 1e6:+.1f}",
             "yes" if layer.chosen else "no", layer.why] for layer in report.layers]
    n = sum(layer.chosen for layer in report.layers)
    quality = (f"{cfg.metric} {report.fidelity:.4g}" if train else f"worst cosine {report.fidelity:.5f}")
    where = f"{report.plan_default} with {len(report.layers) - n} fp32 islands" \
        if train and n else f"{n} of {len(report.layers)} layers converted"
    budget = f"at most {cfg.budget}" + (" per candidate" if train and len(cfg.candidates) > 1 else "")
    chosen = next((e for e in report.evaluations if set(e.layers) == {x.name for x in report.layers if x.chosen}
                   and e.feasible), None) if n else None
    if not cfg.budget:
        notes = ["chosen plan: fp32 throughout; nothing was searched"]
    else:
        notes = [f"chosen plan: {where}, {report.speedup:.2f}x fp32's speed{_interval(chosen)} (measured end to end), "
                 f"{quality}; {len(report.evaluations)} full evaluations ({budget})"]
    notes += list(report.notes)
    for u in report.uniform:
        value = f"{cfg.metric} {u.fidelity:.4g}" if train else f"worst cosine {u.fidelity:.5f}"
        notes.append(f"uniform {u.why}: {u.speedup:.2f}x{_interval(u)}, {value}" + ("" if u.feasible else
                                                                                    " (rejected)"))
    if report.front:
        notes.append("Pareto front seen (speedup, " + ("metric" if train else "worst cosine") + "): " + ", ".join(
            f"{e.speedup:.2f}x/" + (f"{e.fidelity:.4g}" if train else f"{e.fidelity:.5f}") for e in report.front))
    if report.explanation:
        notes.append(report.explanation)
    unit = "training step" if train else "forward"
    if report.base_s:
        notes.append(f"fp32 {unit} {report.base_s * 1e3:.3g} ms (batch {cfg.batch_size}); search took "
                     f"{report.wall_s:.0f} s")
    return title, headers, rows, notes


def _interval(e: PlanEvaluation | None) -> str:
    return f" (95% interval {e.low:.2f}–{e.high:.2f})" if e is not None and e.low is not None else ""


@section(TuneReport)
def _tune(report: TuneReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = tune_doc(report)
    table = html_fragment(headers, rows, notes, classes=True)
    return record_section(title, table, report.environment, report.created, key)
