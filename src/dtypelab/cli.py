"""Command-line interface. Thin: each command calls one public function. Nothing imports this module."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .errors import DtypelabError, TaskError, format_user_traceback

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure which numeric precision your PyTorch model should use, on this hardware.")
err = Console(stderr=True)
# Piped or redirected output has no width; rich would assume 80 columns and fold the table.
out = Console() if Console().is_terminal else Console(width=200)


def _progress() -> Progress:
    """Transient bars on stderr, so stdout carries only the result."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


def _fail(exc: DtypelabError) -> typer.Exit:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    cause = exc.__cause__
    if isinstance(exc, TaskError) and cause is not None and format_user_traceback(cause):
        err.print(format_user_traceback(cause).rstrip(), highlight=False, markup=False)
    return typer.Exit(2)


class _Bars:
    """Rich progress bars fed by bench() events: one bar per policy."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.bars = progress, {}

    def __call__(self, event) -> None:
        p = self.progress
        if event.kind == "probe":
            self.bars["probe"] = p.add_task(event.label, total=None)
        elif event.kind == "start":
            if "probe" in self.bars:
                p.remove_task(self.bars.pop("probe"))
            self.bars[event.policy] = p.add_task(event.label or event.policy, total=event.total or None)
        elif event.kind == "step" and event.policy in self.bars:
            p.update(self.bars[event.policy], completed=event.done, total=event.total)
        elif event.kind == "done" and event.policy in self.bars:
            r = event.result
            p.remove_task(self.bars.pop(event.policy))
            colour = "green" if r.status == "ok" else "red"
            p.console.print(f"{event.label or r.policy}: [{colour}]{r.status}[/] in {r.wall_s:.1f} s"
                            + (f" — {r.reason}" if r.reason else ""), highlight=False)


@app.command()
def bench(
    task: Annotated[str, typer.Argument(help="built-in name (digits, checkerboard, charlm), "
                                             "path/file.py:make_task or pkg.module:make_task")],
    policies: Annotated[str | None, typer.Option("--policies", "-p", help="comma-separated; default: all")] = None,
    mode: Annotated[str, typer.Option(help="train, or infer (forward latency and output fidelity)")] = "train",
    steps: Annotated[int | None, typer.Option(help="training steps (infer: timed forward passes)")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b")] = None,
    warmup: Annotated[int | None, typer.Option(help="steps excluded from timing [default: steps/10, ≤10]")] = None,
    tolerance: Annotated[str, typer.Option(help="allowed metric change vs fp32: 1% or an absolute 0.005")] = "1%",
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N [default: cuda if present]")] = None,
    seed: int = 0,
    force: Annotated[bool, typer.Option(help="run policies measured to be pathologically slow here")] = False,
    timeout: Annotated[float, typer.Option(help="time limit per policy, seconds")] = 600.0,
    threads: Annotated[int | None, typer.Option(help="torch threads per run [default: torch's]")] = None,
    json: Annotated[str | None, typer.Option("--json", help="result file [default: dtypelab-results/…]")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, html or json")] = "table",
) -> None:
    """Train TASK under each precision policy; print speed, memory, metric and a recommendation."""
    from .bench import bench as run_bench
    from .bench import default_result_path

    path = json or default_result_path(task, mode)
    try:
        _check_format(fmt)
        with _progress() as progress:
            report = run_bench(task, policies, mode=mode, steps=steps, batch_size=batch_size, warmup=warmup,
                               tolerance=tolerance, device=device, seed=seed, force=force, timeout_s=timeout,
                               threads=threads, json_path=path, on_event=_Bars(progress))
    except DtypelabError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: policies that finished are saved in {path}")
        raise typer.Exit(130) from None
    _emit(report, fmt)
    err.print(f"[dim]results saved to {path}; re-render with: dtypelab show {path}[/]")


@app.command()
def show(
    path: Annotated[str, typer.Argument(help="a result file written by dtypelab bench or audit")],
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, html or json")] = "table",
    top: Annotated[int, typer.Option(help="audit: rows to show, riskiest first (0: all)")] = 0,
) -> None:
    """Re-render a saved result."""
    from .results import AuditReport, load_record

    try:
        _check_format(fmt)
        report = load_record(path)
    except DtypelabError as exc:
        raise _fail(exc) from None
    if isinstance(report, AuditReport):
        _emit_audit(report, fmt, top)
    else:
        _emit(report, fmt)


@app.command()
def formats(
    value: Annotated[list[float] | None, typer.Option("--value", "-v", help="show how this value is stored "
                                                      "in each format (repeatable)")] = None,
    only: Annotated[str | None, typer.Option("--formats", "-f", help="comma-separated formats [default: all]")] = None,
    device: Annotated[str | None, typer.Option(help="device whose native support is shown")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, html or json")] = "table",
) -> None:
    """Every numeric format's range and precision, computed; with --value, what storing a value does."""
    from .castcheck import analyze_values
    from .formats import formats as all_formats
    from .formats import parse_formats
    from .hardware import probe
    from .render_numeric import formats_doc, values_doc

    try:
        _check_format(fmt)
        chosen = list(parse_formats(only)) if only else list(all_formats().values())
        if value:
            casts = analyze_values(value, chosen)
            _emit_doc(values_doc(casts), fmt, casts)
        else:
            hw = probe(device, budget_s=0.05)
            _emit_doc(formats_doc(chosen, hw), fmt, chosen)
    except DtypelabError as exc:
        raise _fail(exc) from None


@app.command()
def cast(
    file: Annotated[str, typer.Argument(help=".pt/.pth/.bin (loaded with weights_only), .safetensors, .npy, .npz")],
    to: Annotated[str, typer.Option("--to", "-t", help="target format, e.g. fp16, bf16, fp8, int8")],
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, html or json")] = "table",
) -> None:
    """What converting every tensor in FILE to a format does: overflow, underflow, error, SQNR, bytes."""
    from .castcheck import cast_file
    from .formats import get_format
    from .render_numeric import cast_doc

    try:
        _check_format(fmt)
        target = get_format(to)
        with _progress() as progress:
            bar = progress.add_task(f"casting to {target.name} (elements)", total=None)
            report = cast_file(file, to, lambda done, total: progress.update(bar, completed=done, total=total))
    except DtypelabError as exc:
        raise _fail(exc) from None
    _emit_doc(cast_doc(report, target), fmt, report)


@app.command()
def audit(
    task: Annotated[str, typer.Argument(help="built-in name, path/file.py:make_task or pkg.module:make_task")],
    policy: Annotated[str, typer.Option("--policy", "-p", help="precision policy to train under")] = "fp32",
    steps: Annotated[int, typer.Option(help="training steps")] = 20,
    every: Annotated[int, typer.Option(help="measure every N-th step (hooks stay idle on the others)")] = 1,
    layers: Annotated[str | None, typer.Option(help="regular expression on module / parameter names")] = None,
    formats: Annotated[str, typer.Option("--formats", "-f", help="candidate formats, comma-separated")] = (
        "float16,bfloat16,float8_e4m3fn,float8_e5m2"),
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N [default: cuda if present]")] = None,
    seed: int = 0,
    force: Annotated[bool, typer.Option(help="run a policy measured to be pathologically slow here")] = False,
    threads: Annotated[int | None, typer.Option(help="torch threads [default: torch's]")] = None,
    json: Annotated[str | None, typer.Option("--json", help="result file [default: dtypelab-results/…]")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, markdown, html or json")] = "table",
    top: Annotated[int, typer.Option(help="rows to show, riskiest first (0: all; the JSON has all)")] = 25,
) -> None:
    """Per-layer value ranges of activations and gradients against fp16, bf16 and fp8, sorted by risk."""
    from .audit import audit as run_audit
    from .bench import default_result_path

    path = json or default_result_path(task, "audit")
    try:
        _check_format(fmt)
        with _progress() as progress:
            bar = progress.add_task(f"audit {task} ({policy})", total=steps)
            report = run_audit(task, policy=policy, steps=steps, every=every, layers=layers, formats=formats,
                               batch_size=batch_size, seed=seed, device=device, threads=threads, json_path=path,
                               force=force,
                               progress=lambda done, total: progress.update(bar, completed=done))
    except DtypelabError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: the steps measured so far are saved in {path}")
        raise typer.Exit(130) from None
    _emit_audit(report, fmt, top)
    err.print(f"[dim]results saved to {path}; re-render with: dtypelab show {path}[/]")
    if report.status == "failed":  # what was measured is shown and saved; the exit code still says so
        err.print(f"[bold red]error:[/] training failed after {len(report.losses)} steps: {report.reason}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def policies(device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N")] = None) -> None:
    """List the precision policies and whether each applies on this hardware, with the reason."""
    from .bench import policy_table

    try:
        rows = policy_table(device)
    except DtypelabError as exc:
        raise _fail(exc) from None
    from rich.table import Table

    table = Table("policy", "what it does", "here")
    for name, summary, verdict in rows:
        table.add_row(name, summary, verdict)
    out.print(table)


@app.command()
def hardware(device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N")] = None) -> None:
    """Show what this machine can do: flags and measured matmul throughput per dtype."""
    from .hardware import probe

    try:
        hw = probe(device)
    except DtypelabError as exc:
        raise _fail(exc) from None
    out.print(f"device      {hw.device} ({hw.device_name})")
    out.print(f"cpu         {hw.cpu_name}; torch capability {hw.cpu_capability}; {hw.threads} threads")
    out.print(f"cpu flags   {' '.join(hw.cpu_flags) or '(unknown)'}")
    if hw.cuda_capability:
        out.print(f"cuda        capability {hw.cuda_capability[0]}.{hw.cuda_capability[1]}")
    for dtype, gflops in hw.gflops.items():
        native = {True: "native", False: "not native", None: ""}[hw.native(dtype)]
        slow = hw.slow_reason(dtype)
        out.print(f"{dtype:11s} {gflops:10.3g} GFLOP/s  {native}{'  — ' + slow if slow else ''}", highlight=False)


def _check_format(fmt: str) -> None:
    from .render import FORMATS

    if fmt not in FORMATS:
        raise DtypelabError(f"unknown format {fmt!r}: use {', '.join(FORMATS)}")


def _emit(report, fmt: str) -> None:
    from .render import render, render_table

    if fmt == "table":
        render_table(report, out)
    else:
        sys.stdout.write(render(report, fmt))


def _emit_doc(doc, fmt: str, data, styles=None, wrap=None) -> None:
    from .render_numeric import emit, to_json

    if fmt == "json":
        sys.stdout.write(to_json(data))
    else:
        text = emit(doc, fmt, out, styles, wrap)
        if text is not None:
            sys.stdout.write(text)


def _emit_audit(report, fmt: str, top: int = 0) -> None:
    from .render_numeric import audit_doc

    doc, styles, wrap = audit_doc(report, top)
    _emit_doc(doc, fmt, report, styles, wrap)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
