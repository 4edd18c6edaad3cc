"""What every command shares: the typer app, consoles, one-line errors, progress (bars on a terminal, plain lines
in a log) and the rendering of a record.

The CLI is thin: each command builds one validated options object and calls one public function. Its modules
import the capabilities inside the commands, not at the top: ``dtypelab --help`` then starts without torch (a
fraction of a second instead of two). That is start-up time, not a way around an import cycle.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dtypelab.core.errors import DtypelabError, TaskError, format_user_traceback

FORMATS = ("table", "markdown", "html", "json")
HEARTBEAT_S = 30.0

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure which numeric precision your PyTorch model should use, on this hardware.")
err = Console(stderr=True)
# Piped or redirected output has no width: rich would assume 80 columns; COLUMNS still says how wide a log is.
out = Console() if Console().is_terminal else Console(width=int(os.environ.get("COLUMNS", "0") or 0) or 200)


def progress_bars() -> Progress:
    """Transient bars on stderr, so stdout carries only the result."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


@contextlib.contextmanager
def policy_progress(label: str) -> Iterator[Callable[[str, int, int], None]]:
    """Progress over policies, ``(policy, done, total)``: a bar on a terminal; in a log, a line per policy done with
    the seconds since the start."""
    if err.is_terminal:
        with progress_bars() as bars:
            bar = bars.add_task(label, total=None)
            yield lambda name, done, total: bars.update(bar, completed=done, total=total,
                                                        description=f"{label}: {name} done")
        return
    start = time.monotonic()

    def line(name: str, done: int, total: int) -> None:
        sys.stderr.write(f"[{time.monotonic() - start:6.0f} s] {label}: {name} ({done}/{total} policies)\n")
        sys.stderr.flush()

    yield line


def fail(exc: DtypelabError) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    cause = exc.__cause__
    if isinstance(exc, TaskError) and cause is not None and format_user_traceback(cause):
        err.print(format_user_traceback(cause).rstrip(), highlight=False, markup=False)
    return typer.Exit(2)


@contextlib.contextmanager
def guarded(interrupted: str = "") -> Iterator[None]:
    """A user mistake becomes a one-line error (exit 2); Ctrl-C says what was kept (exit 130)."""
    try:
        yield
    except DtypelabError as exc:
        raise fail(exc) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]{': ' + escape(interrupted) if interrupted else ''}")
        raise typer.Exit(130) from None


def check_format(fmt: str, formats: tuple[str, ...] = FORMATS) -> None:
    if fmt not in formats:
        raise DtypelabError(f"unknown format {fmt!r}: use {', '.join(formats)}")


class Bars:
    """Rich progress bars fed by a capability's events: one bar per policy (or phase)."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.bars = progress, {}

    def __call__(self, event: Any) -> None:
        handle = getattr(self, f"on_{event.kind}", None)  # an event kind a sink does not show is ignored
        if handle is not None:
            handle(event)

    def on_probe(self, event: Any) -> None:
        self.bars["probe"] = self.progress.add_task(event.label, total=None)

    def on_start(self, event: Any) -> None:
        if "probe" in self.bars:
            self.progress.remove_task(self.bars.pop("probe"))
        self.bars[event.policy] = self.progress.add_task(event.label or event.policy, total=event.total or None)

    def on_step(self, event: Any) -> None:
        if event.policy in self.bars:
            self.progress.update(self.bars[event.policy], completed=event.done, total=event.total or None)

    def on_state(self, event: Any) -> None:  # a fanned-out job: pending, running
        if event.policy in self.bars:
            self.progress.update(self.bars[event.policy], description=f"{event.policy}: {event.label}",
                                 completed=event.done, total=event.total or None)

    def on_done(self, event: Any) -> None:
        if event.policy not in self.bars:
            return
        r = event.result
        self.progress.remove_task(self.bars.pop(event.policy))
        colour = "green" if r.status == "ok" else "red"
        self.progress.console.print(f"{escape(r.policy if event.kind == 'done' else event.label or r.policy)}: "
                                    f"[{colour}]{r.status}[/] in {r.wall_s:.1f} s"
                                    + (f" — {escape(r.reason)}" if r.reason else ""), highlight=False)

    on_end = on_done  # a phase's end: its own label

    def on_skip(self, event: Any) -> None:
        self.progress.console.print(f"{escape(event.policy)}: [yellow]skipped[/] — {escape(event.result.reason)}",
                                    highlight=False)

    def on_notice(self, event: Any) -> None:
        self.progress.console.print(f"[dim]{escape(event.label)}[/]", highlight=False)


class Lines:
    """Progress as plain lines, for logs and CI where stderr is no terminal (bars would print nothing): one
    line per start, finish or skip, and a heartbeat every ``every`` seconds while one runs (a compile or a slow
    kernel can take minutes without a step)."""

    def __init__(self, every: float) -> None:
        self.every, self.started = every, time.monotonic()
        self.current: tuple[str, float] | None = None  # (label, since)
        self.last = 0.0  # when the last line was printed
        self.done, self.total = 0, 0
        self.states: dict[str, str] = {}  # fanned-out jobs' last said state
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> Lines:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _say(self, text: str) -> None:
        self.last = time.monotonic()
        sys.stderr.write(f"[{self.last - self.started:6.0f} s] {text}\n")
        sys.stderr.flush()

    def _beat(self) -> None:
        while not self.stopped.wait(min(1.0, self.every / 4)):
            with self.lock:
                if self.current and time.monotonic() - self.last >= self.every:  # silent for a whole interval
                    label, since = self.current
                    steps = f", {self.done}/{self.total} steps" if self.total else ""
                    self._say(f"{label}: still running after {time.monotonic() - since:.0f} s{steps}")

    def __call__(self, event: Any) -> None:
        handle = getattr(self, f"on_{event.kind}", None)  # the ~1 s probe gets no line: an error after it stays one
        if handle is not None:
            with self.lock:
                handle(event, event.label or event.policy)

    def on_start(self, event: Any, label: str) -> None:
        self.current, self.done, self.total = (label, time.monotonic()), 0, event.total
        self._say(f"{label}: started" + (f" ({event.total} steps)" if event.total else ""))

    def on_step(self, event: Any, label: str) -> None:
        self.done, self.total = event.done, event.total

    def on_state(self, event: Any, label: str) -> None:
        if self.states.get(event.policy) != event.label:
            self.states[event.policy] = event.label
            self._say(f"{event.policy}: {event.label}")

    def on_done(self, event: Any, label: str) -> None:
        r, self.current = event.result, None
        label = r.policy if event.kind == "done" else label
        self._say(f"{label}: {r.status} in {r.wall_s:.1f} s" + (f" — {r.reason}" if r.reason else ""))

    on_end = on_done

    def on_skip(self, event: Any, label: str) -> None:
        self._say(f"{label}: skipped — {event.result.reason}")

    def on_notice(self, event: Any, label: str) -> None:
        self._say(event.label)


@contextlib.contextmanager
def events() -> Iterator[Callable[[Any], None]]:
    """The event sink a long command reports to: bars on a terminal, plain lines with a heartbeat in a log."""
    if err.is_terminal:
        with progress_bars() as progress:
            yield Bars(progress)
    else:
        with Lines(float(os.environ.get("DTYPELAB_HEARTBEAT_S", HEARTBEAT_S))) as lines:
            yield lines


def emit(record: Any, fmt: str, top: int = 0) -> None:
    """Any record on stdout: a bench report, an audit (``top`` riskiest rows), a trace or a tune record."""
    from dtypelab.render.bench import render, render_table
    from dtypelab.render.drawing import document_of, drop_of, more_of
    from dtypelab.render.numeric import emit as emit_doc
    from dtypelab.render.numeric import to_json

    draw = document_of(record)
    if draw is not None:  # every kind but a bench report, whose table is its own
        if fmt == "json":
            sys.stdout.write(to_json(record))
            return
        doc, styles, wrap = draw(record, top)
        for i, part in enumerate([doc, *more_of(record, top)]):
            text = emit_doc(part, fmt, out, styles if i == 0 else None, wrap if i == 0 else None,
                            drop_of(record) if i == 0 else None)
            if text is not None:
                sys.stdout.write(("\n" if i else "") + text)
    elif fmt == "table":
        render_table(record, out)
    else:
        sys.stdout.write(render(record, fmt))


def emit_doc(doc: Any, fmt: str, data: Any) -> None:
    """A command's own document (the format table, a cast) in a format; ``data`` is what its JSON holds."""
    from dtypelab.render.numeric import emit as emit_table
    from dtypelab.render.numeric import to_json

    if fmt == "json":
        sys.stdout.write(to_json(data))
        return
    text = emit_table(doc, fmt, out)
    if text is not None:
        sys.stdout.write(text)


def saved(path: str) -> None:
    err.print(f"[dim]results saved to {escape(path)}; re-render with: dtypelab show {escape(path)}[/]")


def write_html(record: Any, path: str | None) -> None:
    """``--html PATH``: the report page for what was just measured (saved even when the run failed)."""
    if not path:
        return
    from dtypelab.render import report

    with guarded():
        info = report([record], path)
    err.print(f"[dim]report written to {escape(path)} ({info.bytes / 1024:.0f} KiB, {info.plots} plots)[/]")


def run_recorded(kind: str, task: str, label: str, total: int | None, fmt: str,
                 run: Callable[[Callable[[int, int], None]], Any], kept: str, path: str, top: int = 0,
                 html: str | None = None) -> Any:
    """A single-policy training command (audit, trace): progress bar, Ctrl-C keeping what was measured, the record
    rendered, where it was saved. ``run(progress)`` returns the record."""
    with guarded(f"{kept} {path}"):
        check_format(fmt)
        with progress_bars() as progress:
            bar = progress.add_task(f"{kind} {task} ({label})", total=total)
            record = run(lambda done, n: progress.update(bar, completed=done, total=n))
    emit(record, fmt, top)
    saved(path)
    write_html(record, html)
    return record
