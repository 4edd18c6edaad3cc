"""export: write a task's model converted by a policy, with its size and a reload check."""

from __future__ import annotations

from collections import Counter
from typing import Any

import typer

from dtypelab.cli._common import app, err, guarded, out
from dtypelab.cli._options import argument, command
from dtypelab.core.text import size_text
from dtypelab.inference import ExportOptions


def _plan(spec: str) -> Any:
    import os

    from dtypelab.core.policies import get_policy, load_plan

    return load_plan(spec) if spec.endswith(".json") or os.path.isfile(spec) else get_policy(spec)


def _compressed(opts: ExportOptions, task: str) -> None:
    from dtypelab.serving import export_compressed

    with guarded(), err.status(f"quantizing {task} with {opts.policy}"):
        done = export_compressed(task, _plan(opts.policy), opts.output, opts.seed, opts.calibration)
    layouts = ", ".join(f"{n} {lay}" for lay, n in sorted(Counter(done.layers.values()).items()))
    same = "identical" if done.max_abs_diff == 0 else f"max abs difference {done.max_abs_diff:.3g}"
    for line in (f"wrote {done.path} (compressed-tensors, pack-quantized): {size_text(done.file_bytes)}; layers: "
                 f"{layouts}; left unquantized: {len(done.ignored)}",
                 f"reloaded by transformers: logits {same} to the plan's weights",
                 *([f"calibration: {done.calibration}"] if done.calibration else [])):
        out.print(line, highlight=False, markup=False)
    if done.max_abs_diff != 0:
        raise typer.Exit(1)


def _wants_compressed(opts: ExportOptions) -> bool:
    if opts.format != "auto":
        return opts.format == "compressed-tensors"
    from dtypelab.core.policies import WeightQuant

    with guarded():
        plan = _plan(opts.policy)
    return any(isinstance(c, WeightQuant) and c.layout in ("w4a16", "w8a16") for c in plan.configs)


def _export(opts: ExportOptions, cli: dict[str, Any]) -> None:
    from dtypelab.inference import export

    if _wants_compressed(opts):
        _compressed(opts, cli["task"])
        return
    if opts.calibration:
        err.print("error: --calibration is read by a compressed-tensors export (w4a16-gptq, w4a16-awq) only")
        raise typer.Exit(2)

    with guarded(), err.status(f"converting {cli['task']} with {opts.policy}"):
        info = export(cli["task"], opts.policy, opts.output, weights=opts.weights, seed=opts.seed)
    lines = [f"wrote {info.path} ({info.format}): {size_text(info.file_bytes)}, "
             f"{info.file_bytes / info.fp32_file_bytes:.2f}x fp32's {size_text(info.fp32_file_bytes)}"]
    if info.fp32_linear_weight_bytes and info.linear_weight_bytes:  # a .pte: its weights are inside the program
        lines.append(f"linear-layer weights: {size_text(info.linear_weight_bytes)}, "
                     f"{info.linear_weight_bytes / info.fp32_linear_weight_bytes:.2f}x fp32")
    if info.planned_bytes is not None:
        lines.append(f"activations planned by ExecuTorch's memory planning: {size_text(info.planned_bytes)} (known "
                     "before the device runs it; XNNPACK's own workspace comes on top)")
    if info.cache is not None:
        batch, positions, cache = info.cache
        lines.append(f"a generation program: {batch} sequence(s) of up to {positions} positions, its key/value cache "
                     f"({size_text(cache)}) inside the planned memory; call it with input_ids and cache_position")
    same = "identical" if info.roundtrip_max_abs_diff == 0 else f"max abs difference {info.roundtrip_max_abs_diff:.3g}"
    lines.append(f"weights: {info.weights}; reloaded from the file: outputs {same}")
    for line in lines:  # paths are the user's: never parsed as markup
        out.print(line, highlight=False, markup=False)
    if info.roundtrip_max_abs_diff != 0:
        raise typer.Exit(1)


command(app, "export", ExportOptions, _export, arguments=[argument("task", str, "built-in name, path/file.py:make_task "
                                                                             "or pkg.module:make_task")],
        help="Convert TASK's model with POLICY, write it, and check that the file loads back to the same outputs.")
