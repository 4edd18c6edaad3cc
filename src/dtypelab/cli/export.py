"""export: write a task's model converted by a policy, with its size and a reload check."""

from __future__ import annotations

from typing import Annotated

import typer

from dtypelab.cli._common import _guarded, app, err, out
from dtypelab.cli.options import TaskArg


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 1024:.1f} KB"


@app.command()
def export(
    task: TaskArg,
    policy: Annotated[str, typer.Option("--policy", "-p", "--plan", help="e.g. int8-dyn, fp8-wo, bf16, or a plan file "
                                                                        "(dtypelab tune -o plan.json)")],
    output: Annotated[str, typer.Option("--output", "-o", help="file: .safetensors (.pt for int8-dyn-legacy*)")],
    weights: Annotated[str | None, typer.Option(help="fp32 state dict to convert [default: pretrained, or "
                                                     "train the task's fp32 model here]")] = None,
    seed: int = 0,
) -> None:
    """Convert TASK's model with POLICY, write it, and check that the file loads back to the same outputs."""
    from dtypelab.inference.export import export as run_export

    with _guarded(), err.status(f"converting {task} with {policy}"):
        info = run_export(task, policy, output, weights=weights, seed=seed)
    lines = [f"wrote {info.path} ({info.format}): {_bytes(info.file_bytes)}, "
             f"{info.file_bytes / info.fp32_file_bytes:.2f}x fp32's {_bytes(info.fp32_file_bytes)}"]
    if info.fp32_linear_weight_bytes:
        lines.append(f"linear-layer weights: {_bytes(info.linear_weight_bytes)}, "
                     f"{info.linear_weight_bytes / info.fp32_linear_weight_bytes:.2f}x fp32")
    same = "identical" if info.roundtrip_max_abs_diff == 0 else f"max abs difference {info.roundtrip_max_abs_diff:.3g}"
    lines.append(f"weights: {info.weights}; reloaded from the file: outputs {same}")
    for line in lines:  # paths are the user's: never parsed as markup
        out.print(line, highlight=False, markup=False)
    if info.roundtrip_max_abs_diff != 0:
        raise typer.Exit(1)
