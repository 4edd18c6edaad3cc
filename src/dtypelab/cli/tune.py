"""tune: the fastest per-layer inference plan that keeps the outputs within --min-cosine of fp32's."""

from __future__ import annotations

from typing import Annotated

import typer

from dtypelab.cli._common import _guarded, app, err, out
from dtypelab.cli.options import BatchOpt, DeviceOpt, TaskArg


@app.command()
def tune(
    task: TaskArg,
    mode: Annotated[str, typer.Option(help="infer (training plans are not tuned yet)")] = "infer",
    candidates: Annotated[str, typer.Option(help="configs a layer may take, comma-separated")] = "int8-dyn",
    min_cosine: Annotated[float, typer.Option(help="lowest worst-sample output cosine vs fp32 to accept")] = 0.999,
    output: Annotated[str | None, typer.Option("--output", "-o", help="write the chosen plan here (JSON)")] = None,
    json: Annotated[str | None, typer.Option("--json", help="the tune record (every evaluation)")] = None,
    batch_size: BatchOpt = None,
    device: DeviceOpt = None,
    weights: Annotated[str | None, typer.Option(help="fp32 state dict [default: the task's model as built]")] = None,
) -> None:
    """Per layer, choose a candidate config or fp32 so that inference is as fast as measured possible while the
    worst output cosine vs fp32 stays at or above --min-cosine; every plan reported was timed end to end."""
    from dtypelab.cli._common import _emit_record
    from dtypelab.tune.run import tune as run_tune

    with _guarded(), err.status(f"tuning {task}") as status:
        report = run_tune(task, mode=mode, candidates=candidates, min_cosine=min_cosine, batch_size=batch_size,
                          device=device, weights=weights, output=output, json_path=json,
                          progress=lambda text: status.update(text))
    _emit_record(report, "table")
    if output:
        out.print(f"plan written to {output}: dtypelab bench {report.config.task} --mode infer -p fp32,{output}",
                  highlight=False, markup=False)
