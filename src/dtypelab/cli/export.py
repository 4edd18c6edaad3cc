"""export: write a task's model converted by a policy, with its size and a reload check."""

from __future__ import annotations

from typing import Any

import typer

from dtypelab.cli._common import app, err, guarded, out
from dtypelab.cli._options import argument, command
from dtypelab.core.text import size_text
from dtypelab.inference import ExportOptions


def _export(opts: ExportOptions, cli: dict[str, Any]) -> None:
    from dtypelab.inference import export

    with guarded(), err.status(f"converting {cli['task']} with {opts.policy}"):
        info = export(cli["task"], opts.policy, opts.output, weights=opts.weights, seed=opts.seed)
    lines = [f"wrote {info.path} ({info.format}): {size_text(info.file_bytes)}, "
             f"{info.file_bytes / info.fp32_file_bytes:.2f}x fp32's {size_text(info.fp32_file_bytes)}"]
    if info.fp32_linear_weight_bytes:
        lines.append(f"linear-layer weights: {size_text(info.linear_weight_bytes)}, "
                     f"{info.linear_weight_bytes / info.fp32_linear_weight_bytes:.2f}x fp32")
    same = "identical" if info.roundtrip_max_abs_diff == 0 else f"max abs difference {info.roundtrip_max_abs_diff:.3g}"
    lines.append(f"weights: {info.weights}; reloaded from the file: outputs {same}")
    for line in lines:  # paths are the user's: never parsed as markup
        out.print(line, highlight=False, markup=False)
    if info.roundtrip_max_abs_diff != 0:
        raise typer.Exit(1)


command(app, "export", ExportOptions, _export, arguments=[argument("task", str, "built-in name, path/file.py:make_task "
                                                                             "or pkg.module:make_task")],
        help="Convert TASK's model with POLICY, write it, and check that the file loads back to the same outputs.")
