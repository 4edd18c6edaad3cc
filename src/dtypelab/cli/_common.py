"""What every command shares: the typer app, consoles, progress bars, errors and output."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dtypelab.core.errors import DtypelabError, TaskError, format_user_traceback

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure which numeric precision your PyTorch model should use, on this hardware.")
err = Console(stderr=True)
# Piped or redirected output has no width: rich would assume 80 columns; COLUMNS still says how wide a log is.
out = Console() if Console().is_terminal else Console(width=int(os.environ.get("COLUMNS", "0") or 0) or 200)


def _progress() -> Progress:
    """Transient bars on stderr, so stdout carries only the result."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


def _fail(exc: DtypelabError) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    cause = exc.__cause__
    if isinstance(exc, TaskError) and cause is not None and format_user_traceback(cause):
        err.print(format_user_traceback(cause).rstrip(), highlight=False, markup=False)
    return typer.Exit(2)


@contextlib.contextmanager
def _guarded(interrupted: str = "") -> Iterator[None]:
    """A user mistake becomes a one-line error (exit 2); Ctrl-C says what was kept (exit 130)."""
    try:
        yield
    except DtypelabError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]{': ' + escape(interrupted) if interrupted else ''}")
        raise typer.Exit(130) from None


def _check_format(fmt: str) -> None:
    from dtypelab.render.bench import FORMATS

    if fmt not in FORMATS:
        raise DtypelabError(f"unknown format {fmt!r}: use {', '.join(FORMATS)}")


def _emit(report, fmt: str) -> None:
    from dtypelab.render.bench import render, render_table

    if fmt == "table":
        render_table(report, out)
    else:
        sys.stdout.write(render(report, fmt))


def _emit_doc(doc, fmt: str, data, styles=None, wrap=None) -> None:
    from dtypelab.render.numeric import emit, to_json

    if fmt == "json":
        sys.stdout.write(to_json(data))
    else:
        text = emit(doc, fmt, out, styles, wrap)
        if text is not None:
            sys.stdout.write(text)


def _emit_record(report, fmt: str, top: int = 0) -> None:
    """Any saved record: a bench report, an audit (``top`` riskiest rows) or a trace."""
    from dtypelab.core.results import AuditReport, TraceReport, TuneReport
    from dtypelab.render.numeric import audit_doc
    from dtypelab.render.trace import trace_doc
    from dtypelab.render.tune import tune_doc

    if isinstance(report, AuditReport):
        doc, styles, wrap = audit_doc(report, top)
        _emit_doc(doc, fmt, report, styles, wrap)
    elif isinstance(report, TraceReport):
        _emit_doc(trace_doc(report), fmt, report, wrap={1})
    elif isinstance(report, TuneReport):
        _emit_doc(tune_doc(report), fmt, report, wrap={5})
    else:
        _emit(report, fmt)


def main() -> None:
    app()


def write_html(record: Any, path: str | None) -> None:
    """``--html PATH``: the report page for what was just measured (saved even when the run failed)."""
    if not path:
        return
    from dtypelab.render.report import report

    with _guarded():
        info = report([record], path)
    err.print(f"[dim]report written to {escape(path)} ({info.bytes / 1024:.0f} KB, {info.plots} plots)[/]")


def run_recorded(kind: str, task: str, policy: str, total: int | None, json_path: str | None, fmt: str,
                 run: Callable[..., Any], kept: str, top: int = 0, html: str | None = None) -> Any:
    """A single-policy training command (audit, trace): result path, progress bar, Ctrl-C keeping what was
    measured, the record rendered, where it was saved. ``run(path, progress)`` returns the record."""
    from dtypelab.core.results import default_result_path

    path = json_path or default_result_path(task, kind)
    with _guarded(f"{kept} {path}"):
        _check_format(fmt)
        with _progress() as progress:
            bar = progress.add_task(f"{kind} {task} ({policy})", total=total)
            report = run(path, lambda done, n: progress.update(bar, completed=done, total=n))
    _emit_record(report, fmt, top)
    err.print(f"[dim]results saved to {escape(path)}; re-render with: dtypelab show {escape(path)}[/]")
    write_html(report, html)
    return report
