"""forecast: each policy's peak memory, traced without running, against a GPU you name; --devices lists the GPUs."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from dtypelab.cli._common import (
    app,
    check_format,
    emit,
    err,
    fail,
    guarded,
    out,
    policy_progress,
    progress_bars,
    saved,
    write_html,
)
from dtypelab.cli._options import argument, command, flag
from dtypelab.core.errors import DtypelabError
from dtypelab.forecasting import ForecastOptions


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A bar on a terminal; in a log, a line per policy forecast with the seconds since the start."""
    if err.is_terminal:
        with progress_bars() as bars:
            bar = bars.add_task(label, total=None)
            yield lambda done, total: bars.update(bar, completed=done, total=total)
        return
    start, said = time.monotonic(), [-1]

    def line(done: int, total: int) -> None:
        if done != said[0]:
            said[0] = done
            sys.stderr.write(f"[{time.monotonic() - start:6.0f} s] {label}: {done}/{total} policies\n")
            sys.stderr.flush()

    yield line


def _devices(fmt: str) -> None:
    from dtypelab.render.forecast import devices_table
    from dtypelab.render.numeric import emit as emit_table

    text = emit_table(devices_table(), fmt, out)
    if text is not None:
        sys.stdout.write(text)


def _forecast(opts: ForecastOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.results import default_result_path
    from dtypelab.forecasting import forecast

    fmt = cli["fmt"]
    with guarded():
        check_format(fmt)
        if cli["devices"]:
            _devices(fmt)
            return
        if not cli["task"]:
            raise DtypelabError("give a TASK (a built-in such as gpt2-full or llama2-7b, or FILE.py:make_task), or "
                                "--devices to list the GPUs")
    if opts.mode == "generate":
        _generate(opts, cli)
        return
    path = opts.json_path or default_result_path(cli["task"], "forecast")
    with guarded(f"the policies forecast so far are saved in {path}"), \
            _progress(f"forecasting {cli['task']}") as progress:
        report = forecast(cli["task"], opts.but(json_path=path), progress=progress)
    emit(report, fmt)
    saved(path)
    write_html(report, cli["html"])
    if all(p.status != "ok" for p in report.policies):
        raise fail(DtypelabError("nothing was forecast: every policy was skipped or failed (their reasons are above)"))


def _generate(opts: ForecastOptions, cli: dict[str, Any]) -> None:
    """forecast --mode generate: each serving policy traced for the device (dtypelab.serving)."""
    from dtypelab.core.results import default_result_path
    from dtypelab.serving import serve_forecast

    path = opts.json_path or default_result_path(cli["task"], "generate-forecast")
    with guarded(f"the policies forecast so far are saved in {path}"), \
            policy_progress(f"forecasting {cli['task']} serving") as progress:
        report = serve_forecast(cli["task"], opts.but(json_path=path), on_progress=progress)
    emit(report, cli["fmt"])
    saved(path)
    write_html(report, cli["html"])
    if all(p.status != "ok" for p in report.policies):
        raise fail(DtypelabError("nothing was forecast: every policy failed (their reasons are above)"))


command(app, "forecast", ForecastOptions, _forecast,
        arguments=[argument("task", str | None, "built-in name (gpt2-full, llama2-7b, …), path/file.py:make_task or "
                                                "pkg.module:make_task", default=None)],
        extra=[flag("devices", bool, False, "list the GPUs --device takes, with their memory, and exit", "--devices"),
               flag("fmt", str, "table", "table, markdown, html or json", "--format"),
               flag("html", str | None, None, "also write the offline HTML report here", "--html")],
        help="Each policy's peak memory for TASK, traced on fake tensors from one training step (nothing the size of "
             "the model is allocated): weights, gradients, optimizer state, master copy, activations and temporaries "
             "at the peak, and the inference peak; against --device's memory (or --memory), whether it fits, the "
             "headroom and the largest batch that fits. GPU-only formats are forecast too.")
