"""trace and lint: find where NaN/Inf come from, and the code patterns that make them."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from dtypelab.cli._common import _fail, app, err, out, run_recorded
from dtypelab.cli.options import (
    BatchOpt,
    DeviceOpt,
    ForceOpt,
    FormatOpt,
    HtmlOpt,
    JsonOpt,
    PolicyOpt,
    TaskArg,
    ThreadsOpt,
)
from dtypelab.core.errors import DtypelabError


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def trace(
    ctx: typer.Context,
    task: TaskArg,
    policy: PolicyOpt = "fp32",
    force: ForceOpt = False,
    steps: Annotated[int | None, typer.Option(help="training steps [default: the task's]")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(
        "--checkpoint-every", help="steps between checkpoints [default: chosen so they cost ~2% of the time]")] = None,
    stop_on_skip: Annotated[bool, typer.Option(
        "--stop-on-skip", help="amp-fp16: trace the first step GradScaler skips (default: log skips, stop only "
                               "when the scale collapses below 1)")] = False,
    batch_size: BatchOpt = None,
    seed: int = 0,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    json: JsonOpt = None,
    fmt: FormatOpt = "table",
    html: HtmlOpt = None,
) -> None:
    """Train with a NaN/Inf guard armed; at the first non-finite value, name the op, module, source line
    and cause. Exit 1 when one was found. TASK may be your training script (arguments after --)."""
    from dtypelab.tracing.run import trace as run_trace

    report = run_recorded("trace", task, policy, steps, json, fmt, lambda path, progress: run_trace(
        task, policy=policy, steps=steps, batch_size=batch_size, seed=seed, device=device, threads=threads,
        checkpoint_every=checkpoint_every, stop_on_skip=stop_on_skip, force=force, json_path=path,
        progress=progress, script_args=tuple(ctx.args)), "the steps run so far are saved in", html=html)
    if report.status == "failed":
        err.print(f"[bold red]error:[/] training failed: {escape(report.reason)}", highlight=False, soft_wrap=True)
    if report.status in ("found", "failed"):
        raise typer.Exit(1)


@app.command()
def lint(
    paths: Annotated[list[str] | None, typer.Argument(help="files and directories [default: .]")] = None,
    select: Annotated[str | None, typer.Option(help="rules to run: codes, prefixes (DTL1) or names")] = None,
    ignore: Annotated[str | None, typer.Option(help="rules to skip: codes, prefixes or names")] = None,
    fmt: Annotated[str, typer.Option("--format", help="text or json")] = "text",
    list_rules: Annotated[bool, typer.Option("--list-rules", help="print every rule and exit")] = False,
) -> None:
    """Static checks for precision hazards (naive softmax, log(1+x), fp16 model training, deprecated AMP
    APIs, …). Exit 1 when there are findings. Suppress a line with `# dtypelab: ignore[CODE]`."""
    from dtypelab.lint import RULES, lint_paths

    if list_rules:
        for r in RULES.values():
            out.print(f"[bold]{r.code}[/] {r.name}: {r.why}\n       fix: {r.fix}", highlight=False)
        return
    try:
        if fmt not in ("text", "json"):
            raise DtypelabError(f"unknown format {fmt!r}: use text or json")
        report = lint_paths(paths or ["."], select=select, ignore=ignore)
    except DtypelabError as exc:
        raise _fail(exc) from None
    if fmt == "json":
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
