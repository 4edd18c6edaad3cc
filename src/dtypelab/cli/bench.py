"""bench, show, policies and hardware."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import Progress

from dtypelab.cli._common import _check_format, _emit, _emit_record, _fail, _guarded, _progress, app, err, out
from dtypelab.cli.options import BatchOpt, DeviceOpt, ForceOpt, FormatOpt, JsonOpt, TaskArg, ThreadsOpt
from dtypelab.core.errors import DtypelabError


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
            p.console.print(f"{escape(event.label or r.policy)}: [{colour}]{r.status}[/] in {r.wall_s:.1f} s"
                            + (f" — {escape(r.reason)}" if r.reason else ""), highlight=False)


@app.command()
def bench(
    task: TaskArg,
    policies: Annotated[str | None, typer.Option("--policies", "-p", help="comma-separated; default: all")] = None,
    mode: Annotated[str, typer.Option(help="train, or infer (forward latency and output fidelity)")] = "train",
    steps: Annotated[int | None, typer.Option(help="training steps (infer: timed forward passes)")] = None,
    batch_size: BatchOpt = None,
    warmup: Annotated[int | None, typer.Option(help="steps excluded from timing [default: steps/10, ≤10]")] = None,
    tolerance: Annotated[str, typer.Option(help="allowed metric change vs fp32: 1% or an absolute 0.005")] = "1%",
    device: DeviceOpt = None,
    seed: int = 0,
    force: ForceOpt = False,
    timeout: Annotated[float, typer.Option(help="time limit per policy, seconds")] = 600.0,
    threads: ThreadsOpt = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="infer: SQNR of every layer's output vs fp32")] = False,
    min_cosine: Annotated[float, typer.Option(help="infer: lowest worst-sample output cosine vs fp32 to accept")
                          ] = 0.99,
    json: JsonOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Train TASK under each precision policy (or, with --mode infer, run inference under each, quantized
    int8/fp8 policies included); print speed, memory, size, fidelity, metric and a recommendation."""
    from dtypelab.bench.sweep import bench as run_bench
    from dtypelab.core.results import default_result_path

    path = json or default_result_path(task, mode)
    with _guarded(f"policies that finished are saved in {path}"):
        _check_format(fmt)
        with _progress() as progress:
            report = run_bench(task, policies, mode=mode, steps=steps, batch_size=batch_size, warmup=warmup,
                               tolerance=tolerance, device=device, seed=seed, force=force, timeout_s=timeout,
                               threads=threads, json_path=path, per_layer=per_layer, min_cosine=min_cosine,
                               on_event=_Bars(progress))
    _emit(report, fmt)
    err.print(f"[dim]results saved to {escape(path)}; re-render with: dtypelab show {escape(path)}[/]")


@app.command()
def show(
    path: Annotated[str, typer.Argument(help="a result file written by dtypelab bench, audit or trace")],
    fmt: FormatOpt = "table",
    top: Annotated[int, typer.Option(help="audit: rows to show, riskiest first (0: all)")] = 0,
) -> None:
    """Re-render a saved result."""
    from dtypelab.core.results import load_record

    try:
        _check_format(fmt)
        report = load_record(path)
    except DtypelabError as exc:
        raise _fail(exc) from None
    _emit_record(report, fmt, top)


@app.command()
def policies(device: DeviceOpt = None) -> None:
    """List the precision policies and whether each applies on this hardware, with the reason."""
    from rich.table import Table
    from rich.text import Text

    from dtypelab.bench.sweep import policy_table

    with _guarded():
        rows = policy_table(device)

    table = Table("policy", "what it does", "here")
    for name, summary, verdict in rows:
        table.add_row(Text(name), Text(summary), Text(verdict))
    out.print(table)


@app.command()
def hardware(device: DeviceOpt = None) -> None:
    """Show what this machine can do: flags and measured matmul throughput per dtype."""
    from dtypelab.core.hardware import probe

    with _guarded():
        hw = probe(device)
    out.print(f"device      {hw.device} ({hw.device_name})", markup=False)
    out.print(f"cpu         {hw.cpu_name}; torch capability {hw.cpu_capability}; {hw.threads} threads", markup=False)
    out.print(f"cpu flags   {' '.join(hw.cpu_flags) or '(unknown)'}")
    if hw.cuda_capability:
        out.print(f"cuda        capability {hw.cuda_capability[0]}.{hw.cuda_capability[1]}")
    for dtype, gflops in hw.gflops.items():
        native = {True: "native", False: "not native", None: ""}[hw.native(dtype)]
        slow = hw.slow_reason(dtype)
        out.print(f"{dtype:11s} {gflops:10.3g} GFLOP/s  {native}{'  — ' + slow if slow else ''}", highlight=False)


