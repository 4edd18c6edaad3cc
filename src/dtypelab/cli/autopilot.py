"""autopilot: train in a low-precision start configuration and move a layer out of it when its numbers say so."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dtypelab.cli._common import app, err, out, run_recorded
from dtypelab.cli._options import argument, command, flag
from dtypelab.piloting import AutopilotOptions


def _autopilot(opts: AutopilotOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.results import default_result_path
    from dtypelab.piloting import autopilot

    path = opts.json_path or default_result_path(cli["task"], "autopilot")

    def said(m: Any) -> None:  # each move as it happens, above the progress bar
        err.print(f"step {m.step}: {escape(m.layer)} {escape(m.from_)} → {escape(m.to)} ({m.cause}): "
                  f"{escape(m.evidence)}", highlight=False, soft_wrap=True)

    report = run_recorded("autopilot", cli["task"], str(opts.start), opts.steps, cli["fmt"], lambda progress: autopilot(
        cli["task"], opts.but(json_path=path, script_args=cli["rest"]), progress=progress, on_move=said),
        "the timeline so far is saved in", path, html=cli["html"])
    if opts.plan_out and report.status != "failed":
        out.print(f"plan written to {opts.plan_out}: dtypelab bench {report.config.task} -p fp32,{opts.start},"
                  f"{opts.plan_out}", highlight=False, markup=False)
    if report.status == "failed":
        err.print(f"[bold red]error:[/] training failed: {escape(report.reason)}", highlight=False, soft_wrap=True)
    if report.status in ("stopped", "failed"):
        raise typer.Exit(1)


command(app, "autopilot", AutopilotOptions, _autopilot,
        arguments=[argument("task", str, "built-in name, path/file.py:make_task, pkg.module:make_task, or your "
                                         "training script (its arguments after --)")], takes_rest=True,
        extra=[flag("fmt", str, "table", "table, markdown, html or json", "--format"),
               flag("html", str | None, None, "also write the offline HTML report (plots) here", "--html")],
        help="Train in --start (amp-fp16 by default) and move a layer to a wider format while training goes on: when "
             "its largest values near the format's limit (or their trend will cross it), when its gradients flush "
             "to zero, or, after rolling back to an in-memory checkpoint, when a non-finite step started in it. "
             "Writes the timeline of moves and the final plan (--plan-out) for bench. Exit 1 when it had to stop. "
             "TASK may be your training script (arguments after --): see the guide for what differs on a script's "
             "loop.")
