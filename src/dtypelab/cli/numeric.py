"""formats, cast and audit: what formats do to values."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from dtypelab.cli._common import _check_format, _emit_doc, _fail, _progress, app, err, run_recorded
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


@app.command()
def formats(
    value: Annotated[list[float] | None, typer.Option("--value", "-v", help="show how this value is stored "
                                                      "in each format (repeatable)")] = None,
    only: Annotated[str | None, typer.Option("--formats", "-f", help="comma-separated formats [default: all]")] = None,
    device: Annotated[str | None, typer.Option(help="device whose native support is shown")] = None,
    fmt: FormatOpt = "table",
) -> None:
    """Every numeric format's range and precision, computed; with --value, what storing a value does."""
    from dtypelab.core.hardware import probe
    from dtypelab.numerics.castcheck import analyze_values
    from dtypelab.numerics.formats import formats as all_formats
    from dtypelab.numerics.formats import parse_formats
    from dtypelab.numerics.tables import formats_doc, values_doc

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
    fmt: FormatOpt = "table",
) -> None:
    """What converting every tensor in FILE to a format does: overflow, underflow, error, SQNR, bytes."""
    from dtypelab.numerics.castcheck import cast_file
    from dtypelab.numerics.formats import get_format
    from dtypelab.numerics.tables import cast_doc

    try:
        _check_format(fmt)
        target = get_format(to)
        with _progress() as progress:
            bar = progress.add_task(f"casting to {target.name} (elements)", total=None)
            report = cast_file(file, to, lambda done, total: progress.update(bar, completed=done, total=total))
    except DtypelabError as exc:
        raise _fail(exc) from None
    _emit_doc(cast_doc(report, target), fmt, report)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def audit(
    ctx: typer.Context,
    task: TaskArg,
    policy: PolicyOpt = "fp32",
    steps: Annotated[int, typer.Option(help="training steps")] = 20,
    every: Annotated[int, typer.Option(help="measure every N-th step (hooks stay idle on the others)")] = 1,
    layers: Annotated[str | None, typer.Option(help="regular expression on module / parameter names")] = None,
    formats: Annotated[str, typer.Option("--formats", "-f", help="candidate formats, comma-separated")] = (
        "float16,bfloat16,float8_e4m3fn,float8_e5m2"),
    batch_size: BatchOpt = None,
    device: DeviceOpt = None,
    seed: int = 0,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
    json: JsonOpt = None,
    fmt: FormatOpt = "table",
    top: Annotated[int, typer.Option(help="rows to show, riskiest first (0: all; the JSON has all)")] = 25,
    html: HtmlOpt = None,
) -> None:
    """Per-layer value ranges of activations and gradients against fp16, bf16 and fp8, sorted by risk. TASK may be
    your training script (arguments after --): its first --steps steps are audited."""
    from dtypelab.numerics.audit import audit as run_audit

    report = run_recorded("audit", task, policy, steps, json, fmt, lambda path, progress: run_audit(
        task, policy=policy, steps=steps, every=every, layers=layers, formats=formats, batch_size=batch_size,
        seed=seed, device=device, threads=threads, json_path=path, force=force, progress=progress,
        script_args=tuple(ctx.args)),
        "the steps measured so far are saved in", top, html)
    if report.status == "failed":  # what was measured is shown and saved; the exit code still says so
        err.print(f"[bold red]error:[/] training failed after {len(report.losses)} steps: {escape(report.reason)}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)


