"""The trace report as a two-column document (table, Markdown, HTML); it only reads TraceReport records."""

from __future__ import annotations

from typing import Any

from dtypelab.core.results import OpEvent, TensorSummary, TraceReport
from dtypelab.core.scaler import scaler_notes
from dtypelab.core.text import num
from dtypelab.render import plots
from dtypelab.render.html import esc, figure, record_section
from dtypelab.render.numeric import Doc
from dtypelab.render.views import document, section


def tensor_text(t: TensorSummary) -> str:
    shape = "×".join(str(d) for d in t.shape) or "scalar"
    text = f"{t.dtype} [{shape}] min {num(t.min, '.4g')} max {num(t.max, '.4g')}"
    pairs = ((t.nan, "NaN"), (t.posinf, "+inf"), (t.neginf, "−inf"), (t.zeros, "zero" if t.zeros == 1 else "zeros"))
    counts = [f"{n} {label}" for n, label in pairs if n]
    return text + (f"; {', '.join(counts)}" if counts else "")


def event_rows(o: OpEvent) -> list[list[str]]:
    op = o.op or "(none: the value came in non-finite)"
    rows = [["pass", o.phase], ["op", op + (f"  (in the backward of {o.backward_of})" if o.backward_of else "")],
            ["module", o.module or "—"]]
    if o.source:
        label = "forward source" if o.phase == "backward" else "source"
        rows.append([label, f"{o.source}  {o.code}"])
        if o.via:
            rows.append(["why this line", o.via])
    rows.append(["diagnosis", o.diagnosis])
    rows += [[f"input {i}", tensor_text(t)] for i, t in enumerate(o.inputs)]
    rows += [["output", tensor_text(t)] for t in o.outputs]
    if o.tensor:
        rows.append(["tensor", o.tensor])
    return rows


def _short(o: OpEvent) -> str:
    where = f" in {o.module}" if o.module else ""
    return f"{o.op or 'input'} ({o.phase}{where}, {o.source or 'no source line'}): {o.diagnosis}"


def _how_traced(report: TraceReport, f: Any) -> list[str]:
    """The row that says how the step was traced: live (one run or two) or replayed from a checkpoint."""
    if report.live and f.replayed_steps:
        return ["traced", f"live, two runs: the first, untraced, went non-finite at step {f.step}; the second ran "
                          f"the script again from the same seed, its first {f.replayed_steps} step(s) untraced; step "
                          f"{f.step}: {f.ops_traced} ops in {f.trace_s:.2f} s"]
    if report.live:
        return ["traced", f"live: every step of the script ran under the op tracer; step {f.step}: {f.ops_traced} "
                          f"ops in {f.trace_s:.2f} s"]
    return ["replay", f"restored the checkpoint of step {f.checkpoint_step}, re-ran {f.replayed_steps} step(s), "
                      f"traced step {f.step}: {f.ops_traced} ops in {f.trace_s:.2f} s"]


def _finding_rows(report: TraceReport, f: Any) -> list[list[str]]:
    rows = [["step", str(f.step)], ["detected", f.trigger]]
    if f.origin is not None:
        rows += event_rows(f.origin)
    if f.reached:
        more = f" and {len(f.reached) - 6} more" if len(f.reached) > 6 else ""
        rows.append(["reached", ", ".join(f.reached[:6]) + more])
    if f.path:
        rows.append(["then", " → ".join(f.path)])
    if len(f.weight_max) > 1:
        (s0, w0), (s1, w1) = f.weight_max[0], f.weight_max[-1]
        rows.append(["weights", f"max |w| {num(w0, '.4g')} at step {s0} → {num(w1, '.4g')} at step {s1}"])
    return [*rows, _how_traced(report, f)]


def _finding_notes(f: Any) -> list[str]:
    notes = []
    if not f.reproduced:
        notes.append("the replay did not reproduce a non-finite loss, gradient or weight (non-deterministic "
                     "kernels?); the origin shown is the first non-finite value the replay created"
                     if f.origin else "the replay did not reproduce the non-finite value (non-deterministic "
                     "kernels?); nothing to blame")
    same = [o for o in f.others if f.origin and (o.op, o.phase) == (f.origin.op, f.origin.phase)]
    if same:
        names = [o.tensor or o.module for o in same if o.tensor or o.module]
        listed = f": {', '.join(names[:4])}{', …' if len(names) > 4 else ''}" if names else ""
        notes.append(f"{f.origin.op} created non-finite values in {len(same)} more tensor"
                     f"{'s' if len(same) > 1 else ''} in this step{listed}")
    notes += [f"also created in this step, not what reached the detector: {_short(o)}"
              for o in f.others if o not in same][:3]
    if f.masks:
        notes.append(f"{f.masks} intentional infinit{'ies' if f.masks > 1 else 'y'} (−inf masks) seen and "
                     "not reported as errors")
    return notes


@document(TraceReport, wrap={1})
def trace_doc(report: TraceReport) -> Doc:
    cfg, f = report.config, report.finding
    head = f"dtypelab trace: {cfg.task_name or cfg.task} · {cfg.policy}"
    notes: list[str] = []
    if report.status == "found" and f is not None:
        title = f"{head} · first non-finite value at step {f.step}"
        rows, notes = _finding_rows(report, f), _finding_notes(f)
    else:
        steps = len(report.losses)
        title = f"{head} · {'no NaN/Inf in ' if report.status == 'clean' else ''}{steps} steps"
        rows = [["status", report.status + (f": {report.reason}" if report.reason else "")], ["steps", str(steps)]]
        if report.losses:
            rows.append(["loss", f"{num(report.losses[0], '.4g')} → {num(report.losses[-1], '.4g')}"])
    if not report.live:
        rows.append(["checkpoints", f"every {report.checkpoint_every} step(s), {report.checkpoint_s * 1e3:.2f} ms "
                                    "each" + (" (chosen from the measured cost)" if not cfg.checkpoint_every else "")])
    notes += scaler_notes(report.scaler, len(report.losses))
    if report.scaler.get("grad_scale"):
        scales = report.scaler["grad_scale"]
        rows.append(["loss scale", f"{scales[0]:g} → {scales[-1]:g} (min {min(scales):g})"])
    return title, ["", "value"], rows, notes


@section(TraceReport)
def _trace(report: TraceReport, key: str, layers: str | None = None) -> str:
    title, _, rows, notes = trace_doc(report)
    card = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in rows)
    body = (f"<table class='card' id='{key}-card'><tbody>{card}</tbody></table>"
            + ("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>" if notes else ""))
    if len(report.losses) > 1:
        body += figure(plots.loss_curves([report.config.policy], [report.losses]),
                        "Loss up to the stop: a jump just before the first non-finite value points at the step that "
                        "broke it.", f"{key}-loss")
    return record_section(title, body, report.environment, report.created, key)
