"""bench, show, policies and hardware."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import Progress

from dtypelab.cli._common import (
    _check_format,
    _emit,
    _emit_record,
    _fail,
    _guarded,
    _progress,
    app,
    err,
    out,
    write_html,
)
from dtypelab.cli.options import (
    BatchOpt,
    DeviceOpt,
    ForceOpt,
    FormatOpt,
    HardwareOpt,
    HtmlOpt,
    JsonOpt,
    TaskArg,
    ThreadsOpt,
)
from dtypelab.core.errors import DtypelabError

HEARTBEAT_S = 30.0


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
        elif event.kind in ("done", "end") and event.policy in self.bars:
            r = event.result
            p.remove_task(self.bars.pop(event.policy))
            colour = "green" if r.status == "ok" else "red"
            p.console.print(f"{escape(event.label or r.policy)}: [{colour}]{r.status}[/] in {r.wall_s:.1f} s"
                            + (f" — {escape(r.reason)}" if r.reason else ""), highlight=False)
        elif event.kind == "skip":
            p.console.print(f"{escape(event.policy)}: [yellow]skipped[/] — {escape(event.result.reason)}",
                            highlight=False)
        elif event.kind == "notice":
            p.console.print(f"[dim]{escape(event.label)}[/]", highlight=False)


class _Lines:
    """Progress as plain lines, for logs and CI where stderr is no terminal (bars would print nothing): one
    line per policy start, finish or skip, and a heartbeat every ``every`` seconds while one runs (a compile
    or a slow kernel can take minutes without a step)."""

    def __init__(self, every: float) -> None:
        self.every, self.started = every, time.monotonic()
        self.current: tuple[str, float] | None = None  # (label, since)
        self.last = 0.0  # when the last line was printed
        self.done, self.total = 0, 0
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> _Lines:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _say(self, text: str) -> None:
        self.last = time.monotonic()
        sys.stderr.write(f"[{self.last - self.started:6.0f} s] {text}\n")
        sys.stderr.flush()

    def _beat(self) -> None:
        while not self.stopped.wait(min(1.0, self.every / 4)):
            with self.lock:
                if self.current and time.monotonic() - self.last >= self.every:  # silent for a whole interval
                    label, since = self.current
                    steps = f", {self.done}/{self.total} steps" if self.total else ""
                    self._say(f"{label}: still running after {time.monotonic() - since:.0f} s{steps}")

    def __call__(self, event) -> None:
        with self.lock:
            label = event.label or event.policy
            if event.kind == "start":  # (the ~1 s probe gets no line: an error after it must stay one line)
                self.current, self.done, self.total = (label, time.monotonic()), 0, event.total
                self._say(f"{label}: started" + (f" ({event.total} steps)" if event.total else ""))
            elif event.kind == "step":
                self.done, self.total = event.done, event.total
            elif event.kind in ("done", "end"):
                r, self.current = event.result, None
                self._say(f"{label}: {r.status} in {r.wall_s:.1f} s" + (f" — {r.reason}" if r.reason else ""))
            elif event.kind == "skip":
                self._say(f"{label}: skipped — {event.result.reason}")
            elif event.kind == "notice":
                self._say(event.label)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    task: TaskArg,
    policies: Annotated[str | None, typer.Option("--policies", "-p", help="comma-separated; default: all")] = None,
    plan: Annotated[str | None, typer.Option(help="plan file(s) (dtypelab tune -o), measured beside --policies or, "
                                                  "without it, beside the default policies")] = None,
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
    budget: Annotated[str, typer.Option(help="time for the whole sweep: policies estimated (from the fp32 run and "
                                             "the probe) not to fit are skipped; 15m, 900s, 0 for none")] = "15m",
    json: JsonOpt = None,
    fmt: FormatOpt = "table",
    html: HtmlOpt = None,
    rounds: Annotated[int | None, typer.Option(help="interleaved timing rounds after the runs, for paired speedups "
                                                    "with intervals; 0: off [default: 5 train, 3 infer]")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="exit 3 when the machine was too disturbed to decide")
                      ] = False,
    profile: Annotated[bool, typer.Option("--profile", help="after each policy, profile a few steps: step breakdown, "
                                                            "top ops, achieved FLOP/s, dtype coverage, and why")
                       ] = False,
    trace_dir: Annotated[str | None, typer.Option(help="with --profile: write each policy's raw Chrome trace "
                                                       "(TensorBoard, Perfetto) to this folder")] = None,
    nproc: Annotated[int | None, typer.Option(help="run every policy under torchrun on N ranks per node (gloo on "
                                                   "CPU, NCCL on CUDA); policies may add +ddp-fp16, +ddp-bf16, "
                                                   "+ddp-powersgd, +fsdp, +fsdp-bf16-params-fp32-reduce",
                                              rich_help_panel="Distributed")] = None,
    nnodes: Annotated[int, typer.Option(help="nodes (torchrun --nnodes); run the same command on each",
                                        rich_help_panel="Distributed")] = 1,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of the rendezvous (torchrun "
                                                           "--rdzv-endpoint)", rich_help_panel="Distributed")] = None,
    torchrun_args: Annotated[str | None, typer.Option(help="more torchrun arguments, unchanged: '--node-rank 1 "
                                                           "--rdzv-id job7'", rich_help_panel="Distributed")] = None,
    link_gbps: Annotated[str | None, typer.Option(help="links for the scaling estimate: Gbit/s numbers or presets "
                                                       "25gbe, 100gbe, pcie4, nvlink4 [default: all four presets]",
                                                  rich_help_panel="Distributed")] = None,
    hardware: HardwareOpt = None,
) -> None:
    """Train TASK under each precision policy (or, with --mode infer, run inference under each, quantized
    int8/fp8 policies included); print speed, memory, size, fidelity, metric and a recommendation. TASK may be
    your own training script (train.py, using dtypelab.session()); its arguments go after --. Exit 1 when the fp32
    baseline did not complete (nothing to compare with), 3 with --strict when the machine was too busy to decide."""
    from dtypelab.core.results import default_result_path
    from dtypelab.sweep.sweep import bench as run_bench

    path = json or default_result_path(task, mode)
    with _guarded(f"policies that finished are saved in {path}"):
        _check_format(fmt)
        kwargs = dict(mode=mode, steps=steps, batch_size=batch_size, warmup=warmup, tolerance=tolerance,
                      device=device, seed=seed, force=force, timeout_s=timeout, threads=threads, json_path=path,
                      per_layer=per_layer, min_cosine=min_cosine, budget=budget, rounds=rounds,
                      profile=profile, trace_dir=trace_dir, script_args=tuple(ctx.args), nproc=nproc, nnodes=nnodes,
                      plan=plan, rdzv_endpoint=rdzv_endpoint, torchrun_args=torchrun_args, link_gbps=link_gbps,
                      hardware=hardware)
        if err.is_terminal:
            with _progress() as progress:
                report = run_bench(task, policies, on_event=_Bars(progress), **kwargs)
        else:
            with _Lines(float(os.environ.get("DTYPELAB_HEARTBEAT_S", HEARTBEAT_S))) as lines:
                report = run_bench(task, policies, on_event=lines, **kwargs)
    _emit(report, fmt)
    err.print(f"[dim]results saved to {escape(path)}; re-render with: dtypelab show {escape(path)}[/]")
    write_html(report, html)
    from dtypelab.core.judging import recommend

    rec = recommend(report)
    if rec.no_baseline:
        err.print("[bold red]error:[/] the fp32 baseline did not complete: nothing to compare the policies with",
                  highlight=False)
        raise typer.Exit(1)
    if strict and rec.undecided:
        err.print("[bold red]--strict:[/] the machine was too disturbed to decide", highlight=False)
        raise typer.Exit(3)


@app.command()
def report(
    paths: Annotated[list[str], typer.Argument(help="result files of bench, audit, trace (or lint --format json)")],
    output: Annotated[str, typer.Option("--output", "-o", help="the HTML file to write")] = "report.html",
    title: Annotated[str, typer.Option(help="the page's title")] = "dtypelab report",
    layer: Annotated[str | None, typer.Option(help="audit: regular expression on tensor-family names to draw "
                                                   "binade histograms for [default: the riskiest of each kind]")
                     ] = None,
) -> None:
    """One self-contained HTML page (plots, tables, environment, the records themselves) that opens anywhere,
    offline."""
    from dtypelab.render.report import report as make_report

    with _guarded():
        info = make_report(paths, output, title, layer)
    out.print(f"wrote {output}: {info.records} record{'s' if info.records != 1 else ''}, {info.plots} plots, "
              f"{info.bytes / 1024:.0f} KB", highlight=False, markup=False)


@app.command()
def show(
    path: Annotated[str, typer.Argument(help="a result file written by dtypelab bench, audit or trace")],
    fmt: FormatOpt = "table",
    top: Annotated[int, typer.Option(help="audit: rows to show, riskiest first (0: all)")] = 0,
) -> None:
    """Re-render a saved result."""
    from dtypelab.core.records import load_record

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

    from dtypelab.sweep.listing import policy_table

    with _guarded():
        rows = policy_table(device)

    table = Table("policy", "what it does", "here")
    for name, summary, verdict in rows:
        table.add_row(Text(name), Text(summary), Text(verdict))
    out.print(table)
    out.print("Any policy or plan file also runs as NAME+compile (under torch.compile) and, for training with bench "
              "--nproc N, takes a distributed modifier: +ddp (implied), +ddp-fp16, +ddp-bf16, +ddp-powersgd[-rN], "
              "+fsdp, +fsdp-bf16-params-fp32-reduce.", highlight=False, markup=False)


@app.command()
def hardware(device: DeviceOpt = None, json: Annotated[str | None, typer.Option(
        "--json", help="also save the probe here, for --hardware FILE (bench, tune) or DTYPELAB_HARDWARE")] = None
             ) -> None:
    """Show what this machine can do: flags, and measured throughput per dtype and per quantized kernel."""
    from dtypelab.core.hardware import KERNEL_LABELS, measured_probe
    from dtypelab.core.results import plain_json, save_text

    with _guarded():
        hw = measured_probe(device)
        if json:
            save_text(json, plain_json(hw.to_dict()) + "\n")
    lines = [f"device      {hw.device} ({hw.device_name})",
             f"cpu         {hw.cpu_name}; torch capability {hw.cpu_capability}; {hw.threads} threads",
             f"cpu flags   {' '.join(hw.cpu_flags) or '(unknown)'}"]
    if hw.cuda_capability:
        lines.append(f"cuda        capability {hw.cuda_capability[0]}.{hw.cuda_capability[1]}")
    ref = hw.gflops.get("float32")
    lines.append("throughput  GFLOP/s of an n×n matmul (quantized kernels: the same count of multiply-adds)")
    for key, gflops in hw.gflops.items():
        native = {True: "native", False: "not native", None: ""}[hw.native(key)]
        ratio = f"{gflops / ref:6.2f}x fp32" if ref else ""
        what = KERNEL_LABELS.get(key, "")
        slow = hw.slow_reason(key)
        lines.append(f"  {key:17s} {gflops:9.3g}  {ratio}  {native:10s} {what}{'  — ' + slow if slow else ''}".rstrip())
    if hw.disturbed:
        lines.append(f"caution     the probe was disturbed ({hw.disturbed}): these figures are not reliable")
    for line in lines:
        out.print(line, markup=False, highlight=False)
    if json:
        err.print(f"[dim]probe saved to {escape(json)}[/]")
