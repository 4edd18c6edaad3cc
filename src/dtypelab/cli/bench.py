"""bench, report, show, policies and hardware."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dtypelab.cli._common import (
    app,
    check_format,
    emit,
    err,
    events,
    guarded,
    out,
    policy_progress,
    saved,
    write_html,
)
from dtypelab.cli._options import argument, command, flag
from dtypelab.core.errors import DtypelabError, misapplied
from dtypelab.render import HardwareOptions, PoliciesOptions, ReportOptions, ShowOptions
from dtypelab.sweep import BenchOptions

TASK = argument("task", str, "built-in name (digits, checkerboard, charlm, gpt2, decoder, minilm, minilm-ft, tinylm), "
                             "hf:ORG/NAME or hf:PATH (a Hugging Face model), path/file.py:make_task, "
                             "pkg.module:make_task, or your training script (train.py; its arguments after --)")
OUTPUT = [flag("fmt", str, "table", "table, markdown, html or json", "--format"),
          flag("html", str | None, None, "also write the offline HTML report (plots) here", "--html")]


def _generate(opts: BenchOptions, cli: dict[str, Any]) -> None:
    """bench --mode generate: each serving policy measured here (dtypelab.serving)."""
    from dtypelab.core.results import default_result_path
    from dtypelab.serving import serve_bench

    path = opts.json_path or default_result_path(cli["task"], "generate")
    with guarded(f"the record is saved in {path} when the sweep ends"):
        check_format(cli["fmt"])
        if cli["rest"]:
            raise DtypelabError("--mode generate serves a model (tinylm, hf:MODEL, a task file): it takes no script "
                                "arguments")
        with policy_progress(f"generating with {cli['task']}") as progress:
            report = serve_bench(cli["task"], opts.but(json_path=path), on_progress=progress)
    emit(report, cli["fmt"])
    saved(path)
    write_html(report, cli["html"])
    base = next((p for p in report.policies if p.policy == report.config.baseline), None)
    if base is None or base.status != "ok":
        why = f" ({base.status}: {base.reason})" if base is not None and base.reason else ""
        err.print(f"[bold red]error:[/] the {escape(report.config.baseline)} baseline did not complete"
                  f"{escape(why)}: nothing to compare the policies with", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _bench(opts: BenchOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.results import default_result_path
    from dtypelab.sweep import bench

    if opts.mode == "generate":
        _generate(opts, cli)
        return
    path = opts.json_path or default_result_path(cli["task"], opts.mode)
    with guarded(f"policies that finished are saved in {path}"):
        check_format(cli["fmt"])
        with events() as on_event:
            report = bench(cli["task"], options=opts.but(json_path=path, script_args=cli["rest"]), on_event=on_event)
    emit(report, cli["fmt"])
    saved(path)
    write_html(report, cli["html"])
    wrong = next((line for r in report.results if r.status == "failed" and (line := misapplied(r.reason))), "")
    if wrong:  # an option that does not apply, found once the model was built: said as an error, not a failed row
        err.print(f"[bold red]error:[/] {escape(wrong)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    rec = report.recommendation
    if rec.no_baseline:
        base = report.base
        why = f" ({base.status}: {base.reason})" if base is not None and base.reason else ""
        err.print(f"[bold red]error:[/] the {escape(report.baseline)} baseline did not complete{escape(why)}: nothing "
                  "to compare the policies with", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if rec.no_evidence:
        err.print(f"[bold red]error:[/] {escape(rec.reason)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if cli["strict"] and rec.undecided:
        err.print("[bold red]--strict:[/] the machine was too disturbed to decide", highlight=False)
        raise typer.Exit(3)


command(app, "bench", BenchOptions, _bench, arguments=[TASK], takes_rest=True, extra=[
    *OUTPUT, flag("strict", bool, False, "exit 3 when the machine was too disturbed to decide", "--strict")],
    help="Train TASK under each precision policy (or, with --mode infer, run inference under each, quantized "
         "int8/fp8 policies included); print speed, memory, size, fidelity, metric and a recommendation. TASK may "
         "be your own training script (train.py, using dtypelab.session()); its arguments go after --. Exit 1 when "
         "the baseline (fp32, or --baseline) did not complete (nothing to compare with) or a policy that ran timed no "
         "step, 3 with --strict when the machine was too busy to decide.")


def _report(opts: ReportOptions, cli: dict[str, Any]) -> None:
    from dtypelab.render import report

    with guarded():
        info = report(cli["paths"], opts.output, opts.title, opts.layer)
    out.print(f"wrote {opts.output}: {info.records} record{'s' if info.records != 1 else ''}, {info.plots} plots, "
              f"{info.bytes / 1024:.0f} KiB", highlight=False, markup=False)


command(app, "report", ReportOptions, _report,
        arguments=[argument("paths", list[str], "result files of bench, audit, trace, tune (or lint --format json)")],
        help="One self-contained HTML page (plots, tables, environment, the records themselves) that opens "
             "anywhere, offline.")


def _show(opts: ShowOptions, cli: dict[str, Any]) -> None:
    from dtypelab.core.records import load_record

    with guarded():
        check_format(opts.fmt)
        record = load_record(cli["path"])
    emit(record, opts.fmt, opts.top)


command(app, "show", ShowOptions, _show,
        arguments=[argument("path", str, "a result file written by dtypelab bench, audit, trace or tune")],
        help="Re-render a saved result.")


def _policies(opts: PoliciesOptions, cli: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    from dtypelab.core.machine.hardware import hardware_for
    from dtypelab.sweep import policy_table

    with guarded():
        rows = policy_table(opts.device, hardware_for(opts.device, opts.hardware) if opts.hardware else None)
    table = Table("policy", "what it does", "here")
    for name, summary, verdict in rows:
        table.add_row(Text(name), Text(summary), Text(verdict))
    out.print(table)
    out.print("Any policy or plan file also runs as NAME+compile (under torch.compile) and, for training with bench "
              "--nproc N, takes a distributed modifier: +ddp (implied), +ddp-fp16, +ddp-bf16, +ddp-powersgd[-rN], "
              "+fsdp, +fsdp-bf16-params-fp32-reduce. A training policy whose optimizer is Adam or AdamW also "
              "runs with its state in fewer bits: NAME+adam8bit, +adam4bit (torchao), +adamfp8 (CUDA >= 8.9). "
              "A training policy takes +ckpt (its repeated blocks' activations recomputed in the backward: "
              "activation checkpointing) and, for a language model, +chunked-ce or +chunked-ceN (the output "
              "projection and cross-entropy in N chunks, 8 by default: torchtune's). Under --mode generate a weight "
              f"format takes the KV cache's format: NAME+kv-FORMAT, FORMAT one of {', '.join(_kv_formats())}. "
              "Modifiers combine in any order (lora-bf16+ckpt+chunked-ce, int4-wo+kv-fp8+compile).",
              highlight=False, markup=False)


def _kv_formats() -> list[str]:
    from dtypelab.serving import FORMATS

    return [label.removeprefix("kv-") for label in FORMATS]


command(app, "policies", PoliciesOptions, _policies,
        help="List the precision policies and whether each applies on this hardware, with the reason.")


def _hardware(opts: HardwareOptions, cli: dict[str, Any]) -> None:
    import torch

    from dtypelab.core.energy import counter_of
    from dtypelab.core.machine.hardware import KERNEL_LABELS, kernel_path_text, measured_probe
    from dtypelab.core.results import plain_json, save_text

    with guarded():
        hw = measured_probe(opts.device, speed=True)
        if opts.json_path:
            save_text(opts.json_path, plain_json(hw.to_dict()) + "\n")
    lines = [f"device      {hw.device} ({hw.device_name})",
             f"cpu         {hw.cpu_name}; torch capability {hw.cpu_capability}; {hw.threads} threads",
             f"cpu flags   {' '.join(hw.cpu_flags) or '(unknown)'}"]
    if hw.cuda_capability:
        lines.append(f"cuda        capability {hw.cuda_capability[0]}.{hw.cuda_capability[1]}")
    counter, no_counter = counter_of(torch.device(hw.device))
    lines.append(f"energy      {counter + ' (read by bench in its rounds)' if counter else no_counter}")
    ref = hw.gflops.get("float32")
    lines.append("throughput  GFLOP/s of an n×n matmul (quantized kernels: the same count of multiply-adds)"
                 + (f"; of rated: against the {hw.rated_source} peak" if hw.rated_tflops else ""))
    for key, gflops in hw.gflops.items():
        native = {True: "native", False: "not native", None: ""}[hw.native(key)]
        ratio = f"{gflops / ref:6.2f}x fp32" if ref else ""
        rated = hw.rated(key)
        of_rated = (f"{gflops / rated:4.0%} of {rated / 1e3:g} TFLOP/s  " if rated else "") if hw.rated_tflops else ""
        what = KERNEL_LABELS.get(key, "")
        slow = hw.slow_reason(key)
        path = kernel_path_text(hw, key)
        lines.append(f"  {key:17s} {gflops:9.3g}  {ratio}  {native:10s} {of_rated}{what}"
                     f"{'; ' + path if path else ''}{'  — ' + slow if slow else ''}".rstrip())
    if hw.bandwidth_gbs:
        per_dtype = ", ".join(f"{k} {v:g}" for k, v in hw.elementwise_gbs.items())
        lines.append(f"memory      {hw.bandwidth_gbs:g} GB/s a large copy moves (read + written)"
                     + (f"; an elementwise add: {per_dtype} GB/s" if per_dtype else ""))
    if hw.op_floor_us:
        lines.append(f"per op      {hw.op_floor_us:.3g} µs (a tiny training step's time over the ops it runs)")
    if hw.disturbed:
        lines.append(f"caution     the probe was disturbed ({hw.disturbed}): these figures are not reliable")
    for line in lines:
        out.print(line, markup=False, highlight=False)
    if opts.json_path:
        err.print(f"[dim]probe saved to {escape(opts.json_path)}[/]")


command(app, "hardware", HardwareOptions, _hardware,
        help="Show what this machine can do: flags, and measured throughput per dtype and per quantized kernel.")
