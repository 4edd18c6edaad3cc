"""The autopilot record as a document (table, Markdown, HTML): the timeline of moves and rollbacks, then what the run
ended with. It only reads AutopilotReport records."""

from __future__ import annotations

from dtypelab.core.results import AutopilotReport, default_label
from dtypelab.core.scaler import scaler_notes
from dtypelab.core.text import num
from dtypelab.render import plots
from dtypelab.render.html import figure, record_section
from dtypelab.render.numeric import Doc
from dtypelab.render.tables import html_fragment
from dtypelab.render.views import document, section


def _config(c: object) -> str:
    """A rule's config by name: a registered name as written, a written-out config as its label."""
    return default_label(c) if isinstance(c, dict) else str(c)


def _rules(plan: dict) -> str:
    rules = plan.get("rules") or []
    if not rules:
        return "none: every layer stayed in the start configuration"
    return ", ".join(f"{r['pattern']} → {_config(r['config'])}" for r in rules)


@document(AutopilotReport, wrap={5})
def autopilot_doc(report: AutopilotReport) -> Doc:
    cfg = report.config
    title = (f"dtypelab autopilot: {cfg.task_name or cfg.task} · start {cfg.start} · {len(report.moves)} layer"
             f"{'s' if len(report.moves) != 1 else ''} moved, {len(report.rollbacks)} rollback"
             f"{'s' if len(report.rollbacks) != 1 else ''} · {report.status}")
    rows: list[list[str]] = []
    events = [(m.step, 0, m) for m in report.moves] + [(r.step, 1, r) for r in report.rollbacks]
    for _, kind, e in sorted(events, key=lambda t: (t[0], -t[1])):
        if kind == 0:
            rows.append([str(e.step), "move", e.layer, f"{e.from_} → {e.to}", e.cause, e.evidence])
        else:
            back = "step dropped (GradScaler skipped it)" if e.to_step == e.step else f"back to step {e.to_step}"
            rows.append([str(e.step), "rollback", e.layer or "—", back, e.trigger, e.origin])
    if not rows:
        rows.append(["—", "none", "—", "—", "—", "the run failed: see why below" if report.status == "failed" else
                     "no layer came near its format's limits, and no step went non-finite"])
    notes = []
    steps = len(report.losses)
    status = {"ok": f"trained {steps} of {cfg.steps} steps", "stopped": f"stopped after {steps} steps",
              "interrupted": f"interrupted after {steps} steps", "failed": "failed"}.get(report.status, report.status)
    notes.append(status + (f": {report.reason}" if report.reason else "") + ".")
    if report.metrics:
        notes.append("metrics: " + ", ".join(f"{k} {num(v, '.4g')}" for k, v in report.metrics.items()) + ".")
    if report.losses:
        notes.append(f"loss {num(report.losses[0], '.4g')} → {num(report.losses[-1], '.4g')}.")
    if report.final_plan:  # a run that failed before training has none
        notes.append(f"final plan: {_rules(report.final_plan)} (default "
                     f"{_config(report.final_plan.get('default', ''))}).")
    again = ("dropped by rollbacks (a script's data cannot rewind: training went on with its next batch)"
             if report.live else "trained again after rollbacks")
    lost = [f"{report.steps_rolled_back} step{'s' if report.steps_rolled_back != 1 else ''} {again}"] \
        if report.rollbacks else []
    if report.steps_skipped:
        lost.append(f"{report.steps_skipped} skipped by GradScaler")
    if lost:
        notes.append("steps lost: " + ", ".join(lost) + ".")
    if report.samples and report.step_s > 0:
        per = report.sample_s / report.samples
        share = report.sample_s / (report.step_s * max(1, steps))
        how = "" if cfg.sample_every else " (chosen from their cost)"
        notes.append(f"readings: every {report.sample_every} steps{how} ({report.samples} in all), {per * 1e3:.2f} ms "
                     f"each beyond a {report.step_s * 1e3:.2f} ms step: {share:.1%} of the training time; checkpoints "
                     f"every {report.checkpoint_every} step(s), {report.checkpoint_s * 1e3:.2f} ms each.")
    rules = cfg.rules
    horizon = f"{rules.horizon} steps" if rules.horizon else "two readings"
    row = f"{'two' if rules.confirm == 2 else rules.confirm} readings in a row"
    if report.final_plan:
        notes.append(f"rules: a layer moves to {cfg.promote_to} when its largest |value| passes "
                     f"{rules.headroom:.0%} of its format's limit on {row} (at once past {rules.at_once:.0%}), when "
                     f"its trend crosses the limit within {horizon} on {row} (past {rules.trend_from:.0%} of the "
                     f"limit, while its growth keeps {rules.trend_keep:.0%} of the trend's), when more than "
                     f"{rules.underflow_share:.0%} of its weight gradient is flushed below the format's smallest "
                     f"normal on {row}, or when a non-finite step's origin lies in it (after a rollback; at most "
                     f"{cfg.max_rollbacks}).")
    if report.finding is not None and report.finding.origin is not None:
        o = report.finding.origin
        notes.append(f"diagnosis of the last non-finite step ({report.finding.trigger}): {o.op} in "
                     f"{o.module or 'no module'} ({o.phase}{', ' + o.source if o.source else ''}): {o.diagnosis}")
    notes += scaler_notes(report.scaler, steps)
    return title, ["step", "event", "layer", "change", "cause", "evidence"], rows, notes


@section(AutopilotReport)
def _autopilot(report: AutopilotReport, key: str, layers: str | None = None) -> str:
    title, headers, rows, notes = autopilot_doc(report)
    body = html_fragment(headers, rows, notes, classes=True)
    if len(report.losses) > 1:
        body += figure(plots.loss_curves([report.config.start + " (autopilot)"], [report.losses]),
                        "Loss of the steps that count (rolled-back steps are not in it).", f"{key}-loss")
    return record_section(title, body, report.environment, report.created, key)
