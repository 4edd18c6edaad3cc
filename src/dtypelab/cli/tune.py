"""tune: the fastest per-layer plan that keeps the outputs (infer) or the metric (train) close to fp32's."""

from __future__ import annotations

from typing import Annotated

import typer

from dtypelab.cli._common import _guarded, app, err, out
from dtypelab.cli.options import BatchOpt, DeviceOpt, ForceOpt, HardwareOpt, TaskArg


@app.command()
def tune(
    task: TaskArg,
    mode: Annotated[str, typer.Option(help="infer (per-layer fp32 or a candidate) or train (a candidate with fp32 "
                                           "islands)")] = "infer",
    candidates: Annotated[str | None, typer.Option(
        help="configs to choose from, comma-separated [default: int8-dyn for infer, bf16,amp-bf16 for train]")] = None,
    min_cosine: Annotated[float, typer.Option(help="infer: lowest worst-sample output cosine vs fp32 to accept")
                          ] = 0.999,
    tolerance: Annotated[str, typer.Option(help="train: allowed metric change vs fp32: 1% or an absolute 0.005")
                         ] = "1%",
    steps: Annotated[int | None, typer.Option(help="train: steps of each full evaluation [default: the task's]")
                     ] = None,
    probe_steps: Annotated[int | None, typer.Option(help="train: steps of each layer's probe [default: steps/4]")
                           ] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="write the chosen plan here (JSON)")] = None,
    json: Annotated[str | None, typer.Option("--json", help="the tune record (every evaluation)")] = None,
    batch_size: BatchOpt = None,
    device: DeviceOpt = None,
    weights: Annotated[str | None, typer.Option(help="fp32 state dict [default: the task's model as built]")] = None,
    force: ForceOpt = False,
    hardware: HardwareOpt = None,
) -> None:
    """Per layer, choose a candidate config or fp32 so that the model is as fast as measured possible while it
    keeps the constraint: inference, the worst output cosine vs fp32 at or above --min-cosine; training, the task's
    metric within --tolerance of fp32's after the same training. Every plan reported was measured end to end."""
    from dtypelab.cli._common import _emit_record
    from dtypelab.tuning.run import tune as run_tune

    with _guarded(), err.status(f"tuning {task}") as status:
        report = run_tune(task, mode=mode, candidates=candidates, min_cosine=min_cosine, tolerance=tolerance,
                          steps=steps, probe_steps=probe_steps, batch_size=batch_size,
                          device=device, weights=weights, output=output, json_path=json, force=force,
                          hardware=hardware, progress=lambda text: status.update(text))
    _emit_record(report, "table")
    if output:
        out.print(f"plan written to {output}: dtypelab bench {report.config.task} --mode {mode} -p fp32,{output}",
                  highlight=False, markup=False)
