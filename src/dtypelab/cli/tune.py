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
    from rich.table import Table
    from rich.text import Text

    from dtypelab.tune.run import tune as run_tune

    with _guarded(), err.status(f"tuning {task}") as status:
        report = run_tune(task, mode=mode, candidates=candidates, min_cosine=min_cosine, batch_size=batch_size,
                          device=device, weights=weights, output=output, json_path=json,
                          progress=lambda text: status.update(text))
    table = Table(title=Text(f"dtypelab tune: {report.config.task_name} · inference · worst cosine ≥ "
                             f"{report.config.min_cosine:g}"))
    for h in ("layer", "candidate", "1 − cosine alone", "gain µs/call", "chosen", "why"):
        table.add_column(Text(h))
    for layer in report.layers:
        table.add_row(*(Text(c) for c in (layer.name, layer.candidate, f"{layer.sensitivity:.2e}",
                                            f"{layer.gain_s * 1e6:+.1f}", "yes" if layer.chosen else "no", layer.why)))
    out.print(table)
    n = sum(layer.chosen for layer in report.layers)
    lines = [f"chosen plan: {n} of {len(report.layers)} layers converted, {report.speedup:.2f}x fp32's speed "
             f"(measured end to end), worst cosine {report.fidelity:.5f}; {len(report.evaluations)} full "
             f"evaluations of at most {report.config.budget}"]
    lines += [f"uniform {u.why}: {u.speedup:.2f}x, worst cosine {u.fidelity:.5f}"
              + ("" if u.feasible else f" (below {report.config.min_cosine:g})") for u in report.uniform]
    if output:
        lines.append(f"plan written to {output}: dtypelab bench {report.config.task} --mode infer -p fp32,{output}")
    for line in lines:
        out.print(line, highlight=False, markup=False)
