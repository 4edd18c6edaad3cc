"""trace and lint: find where NaN/Inf come from, and the code patterns that make them."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.markup import escape

from dtypelab.cli._common import app, err, guarded, out, run_recorded
from dtypelab.cli._options import argument, command, flag
from dtypelab.lint import LintOptions
from dtypelab.tracing import TraceOptions

TASK = argument("task", str, "built-in name, path/file.py:make_task, pkg.module:make_task, or your training script "
                             "(its arguments after --)")
OUTPUT = [flag("fmt", str, "table", "table, markdown, html or json", "--format"),
          flag("html", str | None, None, "also write the offline HTML report (plots) here", "--html")]


def _trace(opts: TraceOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.results import default_result_path
    from dtypelab.tracing import trace

    path = opts.json_path or default_result_path(cli["task"], "trace")
    report = run_recorded("trace", cli["task"], opts.policy, opts.steps, cli["fmt"], lambda progress: trace(
        cli["task"], opts.but(json_path=path, script_args=cli["rest"]), progress=progress),
        "the steps run so far are saved in", path, html=cli["html"])
    if report.status == "failed":
        err.print(f"[bold red]error:[/] training failed: {escape(report.reason)}", highlight=False, soft_wrap=True)
    if report.status in ("found", "failed"):
        raise typer.Exit(1)


command(app, "trace", TraceOptions, _trace, arguments=[TASK], extra=OUTPUT, takes_rest=True,
        help="Train with a NaN/Inf guard armed; at the first non-finite value, name the op, module, source line and "
             "cause. Exit 1 when one was found. TASK may be your training script (arguments after --).")


def _lint(opts: LintOptions, cli: dict[str, Any]) -> None:
    from dtypelab.lint import RULES, lint_paths

    if opts.list_rules:
        for r in RULES.values():
            out.print(f"[bold]{r.code}[/] {r.name}: {r.why}\n       fix: {r.fix}", highlight=False)
        return
    with guarded():
        report = lint_paths(cli["paths"] or ["."], select=opts.select, ignore=opts.ignore)
    if opts.fmt == "json":
        sys.stdout.write(report.to_json() + "\n")
    else:
        for f in report.findings:
            sys.stdout.write(f"{f.location}: {f.code} [{f.rule}] {f.message}\n    fix: {f.fix}\n")
    rate = report.lines / report.seconds if report.seconds > 0 else 0
    hidden = f", {report.suppressed} suppressed" if report.suppressed else ""
    err.print(f"[dim]{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''}{hidden} in "
              f"{report.files} file{'s' if report.files != 1 else ''} ({report.lines:,} lines, {rate:,.0f} lines/s)[/]")
    if report.findings:
        raise typer.Exit(1)


command(app, "lint", LintOptions, _lint,
        arguments=[argument("paths", list[str] | None, "files and directories [default: .]", default=None)],
        help="Static checks for precision hazards (naive softmax, log(1+x), fp16 model training, deprecated AMP APIs, "
             "…). Exit 1 when there are findings. Suppress a line with `# dtypelab: ignore[CODE]`.")
