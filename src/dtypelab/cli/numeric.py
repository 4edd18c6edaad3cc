"""formats, cast and audit: what formats do to values."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dtypelab.cli._common import app, check_format, emit_doc, err, guarded, progress_bars, run_recorded
from dtypelab.cli._options import argument, command, flag
from dtypelab.numerics import AuditOptions, CastOptions, FormatsOptions


def _formats(opts: FormatsOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.machine.hardware import probe
    from dtypelab.numerics import analyze_values, formats, formats_doc, parse_formats, values_doc

    with guarded():
        check_format(opts.fmt)
        chosen = list(parse_formats(opts.formats)) if opts.formats else list(formats().values())
        if opts.value:
            casts = analyze_values(list(opts.value), chosen)
            emit_doc(values_doc(casts), opts.fmt, casts)
        else:
            emit_doc(formats_doc(chosen, probe(opts.device, budget_s=0.05)), opts.fmt, chosen)


command(app, "formats", FormatsOptions, _formats,
        help="Every numeric format's range and precision, computed; with --value, what storing a value does.")


def _cast(opts: CastOptions, cli: dict[str, Any]) -> None:
    from dtypelab.numerics import cast_doc, cast_file, get_format

    with guarded():
        check_format(opts.fmt)
        target = get_format(opts.to)
        with progress_bars() as progress:
            bar = progress.add_task(f"casting to {target.name} (elements)", total=None)
            report = cast_file(cli["file"], opts.to, lambda done, total: progress.update(bar, completed=done,
                                                                                         total=total))
    emit_doc(cast_doc(report, target), opts.fmt, report)


command(app, "cast", CastOptions, _cast,
        arguments=[argument("file", str, ".pt/.pth/.bin (loaded with weights_only), .safetensors, .npy, .npz")],
        help="What converting every tensor in FILE to a format does: overflow, underflow, error, SQNR, bytes.")


def _audit(opts: AuditOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.results import default_result_path
    from dtypelab.numerics import audit

    path = opts.json_path or default_result_path(cli["task"], "audit")
    report = run_recorded("audit", cli["task"], opts.policy, opts.steps, cli["fmt"], lambda progress: audit(
        cli["task"], opts.but(json_path=path, script_args=cli["rest"]), progress=progress),
        "the steps measured so far are saved in", path, cli["top"], cli["html"])
    if report.status == "failed":  # what was measured is shown and saved; the exit code still says so
        err.print(f"[bold red]error:[/] training failed after {len(report.losses)} steps: {escape(report.reason)}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)


command(app, "audit", AuditOptions, _audit,
        arguments=[argument("task", str, "built-in name, path/file.py:make_task, pkg.module:make_task, or your "
                                         "training script (its arguments after --)")],
        extra=[flag("fmt", str, "table", "table, markdown, html or json", "--format"),
               flag("top", int, 25, "rows to show, riskiest first (0: all; the JSON has all)", "--top"),
               flag("html", str | None, None, "also write the offline HTML report (plots) here", "--html")],
        takes_rest=True,
        help="Per-layer value ranges of activations and gradients against fp16, bf16 and fp8, sorted by risk. TASK "
             "may be your training script (arguments after --): its first --steps steps are audited.")
