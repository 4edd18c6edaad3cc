"""``forecast()``: each policy's peak memory for a task, traced without running it, against a device's memory.

task → options → the target device (a GPU of the table, this machine's, or a size) → the policies → workers that
trace them (two at once on a machine with two cores) → the record, with the answer in a sentence.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from dtypelab.core.backends import quiet
from dtypelab.core.bands import band
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import GIB, device_spec
from dtypelab.core.machine.hardware import HardwareInfo, environment, hardware_for
from dtypelab.core.options import parse_size
from dtypelab.core.policies import (
    REGISTRY,
    STATE_MODIFIERS,
    LoRA,
    Plan,
    defaults,
    get_policy,
    parse_policies,
    policies_for,
    tuned,
)
from dtypelab.core.results import ForecastConfig, ForecastReport, PolicyForecast, TargetDevice, check_writable
from dtypelab.core.task import HF_PREFIX, Task
from dtypelab.core.tasks.hub import with_seq_len
from dtypelab.forecasting.adapters import PLAIN_PASS, UPDATE_COST
from dtypelab.forecasting.answer import answer, device_notes, smallest_device
from dtypelab.forecasting.energy import read_measured, target_power, tokens_per_step, with_energy
from dtypelab.forecasting.job import ForecastJob
from dtypelab.forecasting.options import ForecastOptions
from dtypelab.forecasting.pool import run_parts, worker_count
from dtypelab.forecasting.timing import (
    memory_error,
    rates_for,
    speed_answer,
    speed_probe,
    speedup_error,
    with_speedups,
)
from dtypelab.run import LAUNCHERS, Launcher, Outcome, ProcessLauncher, Target

Progress = Callable[[int, int], None]
# what a worker forecasting a Hugging Face model imports first (transformers' model code: seconds on 2 cores)
HF_PRELOAD = ("transformers.modeling_utils",)
GPU_RESERVE = "0.5GiB"  # the CUDA context and the libraries' workspaces: outside torch's allocator, not traced
# One policy of each memory layout (all: every registered policy): float32; bfloat16 autocast over float32 weights;
# bfloat16 weights, then with Kahan's compensation, then with stochastic rounding and 8-bit Adam state, the
# smallest; float8 training; and the inference formats (int8, float8, int4 weights). bf16-sr alone stores what bf16
# stores, and the 8-bit state's saving shows on its bf16-sr row: both are named when asked for.
# (each kind's module puts its policies in these lists: core.policies.defaults)
DEFAULT_TRAIN = defaults("forecast-train")
DEFAULT_INFER = defaults("forecast-infer")
DEFAULT_DISTRIBUTED = ("fp32+ddp", "amp-bf16+ddp", "fp32+fsdp", "amp-bf16+fsdp", "fp32+fsdp-bf16-params-fp32-reduce",
                       "bf16-sr+fsdp")
STATE_VARIANTS = ("amp-bf16", "bf16-sr")  # -p all: these with each optimizer-state modifier
# A pretrained Hugging Face model (hf:) is fine-tuned: full fine-tuning beside each frozen base, with and without
# activation checkpointing
DEFAULT_FINE_TUNING = defaults("forecast-fine-tuning")


def target_device(device: str | None, memory: Any, reserve: Any) -> TargetDevice:
    """The device a forecast is for; a one-line error for a name the table does not know."""
    size = parse_size(memory, "memory size")
    if memory is not None and size is None:  # "0", "none": parse_size's "no limit", which a forecast has no use for
        raise DtypelabError(f"--memory {memory}: give the memory to fit (24GiB, 80GB), or leave it out for the "
                            "device's (--device)")
    kept = None if reserve in (None, "") else (parse_size(reserve, "reserve") or 0)  # --reserve 0: nothing aside
    if device is None or device.strip() == "":
        kind, name, label, total, source, cc = "cuda", "", "a GPU", None, "", None
    elif device.strip().lower() == "cpu":
        kind, name, label, cc = "cpu", "cpu", "this machine's CPU", None
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "this machine's memory"
    elif device.strip().lower().startswith("cuda"):
        if not torch.cuda.is_available():
            raise DtypelabError(f"--device {device}: no CUDA device here; name a GPU of the table (dtypelab forecast "
                                "--devices) or give --memory SIZE")
        dev = torch.device(device.strip().lower())
        props = torch.cuda.get_device_properties(dev)
        kind, name, label, cc = "cuda", str(dev), props.name, (props.major, props.minor)
        total, source = props.total_memory, "the total capacity torch reports for it"
    else:
        spec = device_spec(device)
        kind, name, label, total, source, cc = "cuda", spec.name, spec.label, spec.memory_bytes, spec.source, \
            spec.capability
    if size is not None:
        total, source = size, "given (--memory)"
        name = name or f"{size / GIB:.4g}GiB"
        label = label if device else f"{size / GIB:.4g} GiB"
    if kept is None:
        kept = parse_size(GPU_RESERVE) if kind == "cuda" and total is not None else 0
    if total is not None and kept >= total:
        said = f"--reserve {reserve}" if reserve is not None else \
            f"the default reserve ({GPU_RESERVE}, the CUDA context)"
        raise DtypelabError(f"{said} keeps all of the {total / GIB:.4g} GiB there is: give more --memory or a smaller "
                            "--reserve")
    return TargetDevice(name, label, kind, total, kept or 0, source, cc)


def choose_policies(spec: str | None, task: Task, nproc: int, fine_tuning: bool = False) -> list[Plan]:
    """The plans to forecast: those named ('all': every registered policy and the optimizer-state variants), or one
    of each memory layout for the task's mode (a pretrained model's, ``fine_tuning``: its fine-tuning policies). With
    several ranks a plan without a distributed modifier is DDP's."""
    infer_only = task.inference_only
    if spec is None:
        names = DEFAULT_DISTRIBUTED if nproc > 1 and not infer_only else (DEFAULT_INFER if infer_only else
                                                                            DEFAULT_FINE_TUNING if fine_tuning else
                                                                            DEFAULT_TRAIN)
        plans = [get_policy(n) for n in names]
    elif spec.strip().lower() == "all":
        modes = ("infer",) if infer_only else ("train", "infer")
        names = list(dict.fromkeys(n for m in modes for n in policies_for(m)))
        if not infer_only:
            names += [f"{base}+{mod}" for base in STATE_VARIANTS for mod in STATE_MODIFIERS]
        plans = [get_policy(n) for n in names]
    else:
        plans = parse_policies(spec)
    programs = [p for p in plans if p.program]
    if programs and spec is not None and spec.strip().lower() == "all":
        plans = [p for p in plans if not p.program]  # measured where they run, never traced
    elif programs:
        raise DtypelabError(f"{', '.join(p.name for p in programs)}: a whole-model {programs[0].program} program is "
                            "measured by bench --mode infer on this CPU (its size and planned memory: export); "
                            "forecast traces eager PyTorch, and a device's latency is not forecast")
    if infer_only:
        trained = [p.name for p in plans if "infer" not in p.modes]
        if trained:
            raise DtypelabError(f"task {task.name} is inference-only: {', '.join(trained)} train (use inference "
                                "policies such as fp32, bf16, int8-wo, fp8-dyn-row, int4-wo)")
    if nproc > 1:
        plans = [p if p.distributed is not None or "train" not in p.modes else
                 get_policy(f"{p.name}+ddp") if p.name in REGISTRY or "+" in p.name else p for p in plans]
    else:
        spread = [p.name for p in plans if p.distributed is not None]
        if spread:
            raise DtypelabError(f"{spread[0]} runs across processes: give --nproc N (its ranks)")
    return plans


def _hardware(target: TargetDevice) -> HardwareInfo | None:
    """What the target computes natively, to say which policies can run there (a GPU by its capability)."""
    if target.kind == "cpu":  # the probe the time model takes its rates from: this CPU probed once
        return speed_probe("cpu")
    if target.capability is None:
        return None
    return HardwareInfo(device="cuda", device_name=target.label, cpu_name="", cpu_flags=(), cpu_capability="",
                        cuda_capability=target.capability, threads=0)


def _launcher(given: Any, target: Target) -> Launcher:
    """The process launcher, or this process for ``inline`` and for a Task object (its functions cannot travel to a
    worker, and a trace on fake tensors needs no isolation to be safe)."""
    if target.given is not None:
        if given not in (None, "inline"):
            raise DtypelabError("a Task object is forecast in this process (launcher='inline'); to use workers, "
                                "give its spec (FILE.py:make_task)")
        return LAUNCHERS["inline"]
    if isinstance(given, str | None):
        if (given or "process") not in LAUNCHERS:
            raise DtypelabError(f"launcher: unknown launcher {given!r}: use process or inline")
        return LAUNCHERS[given or "process"]
    return given


def families(plans: list[Plan]) -> list[list[Plan]]:
    """Policies likely to convert the model alike (the same stored dtype, autocast, rules and distribution, and no
    module conversion of their own) as families, whose worker traces their forward and backward once; the most
    costly family first (a family's forward and backward, then each update: through torchao or torch-optimi one
    parameter at a time, slowest), so that whichever worker is free takes the next."""
    def key(p: Plan) -> tuple[Any, ...]:
        d = p.default
        return d.facts.storage_dtype, d.facts.autocast_dtype, p.rules, p.distributed, "" if PLAIN_PASS(d) else p.name

    def cost(p: Plan) -> int:
        if "train" not in p.modes:
            return 4
        return 10 if p.state is not None else UPDATE_COST(p.default)

    grouped: dict[tuple[Any, ...], list[Plan]] = {}
    for plan in plans:
        grouped.setdefault(key(plan), []).append(plan)
    return sorted(grouped.values(), key=lambda g: -(6 * any("train" in p.modes for p in g) + sum(map(cost, g))))


def cuda_guard_here() -> None:
    """Set the fake CUDA device guard from this (long-lived) thread before the jobs' threads enter fake tensors.

    On a CUDA build of torch with no GPU visible, FakeTensorMode installs a no-op CUDA device guard each time it is
    entered (``torch._C._ensureCUDADeviceGuardSet``). In torch 2.11 that call crashes the process (a segmentation
    fault) when a thread makes it after another thread that made it first has ended: an inline forecast's second
    run, each in a fresh pool thread. Made first from a thread that outlives them, it is safe."""
    if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
        torch._C._ensureCUDADeviceGuardSet()


def _checked(opts: ForecastOptions, target: Target, device: TargetDevice, task_obj: Task) -> list[Plan]:
    """The plans to forecast, once the options are known to make sense together; a one-line error otherwise."""
    spec = target.spec
    if opts.check and device.kind != ("cuda" if torch.cuda.is_available() else "cpu"):
        here = "cuda" if torch.cuda.is_available() else "cpu"
        raise DtypelabError(f"--check runs the steps here ({here}): forecast for --device {here}, or leave out --check")
    plans = tuned(choose_policies(opts.policies, task_obj, opts.nproc, spec.startswith(HF_PREFIX)), opts)
    if opts.baseline and opts.baseline not in {p.name for p in plans}:
        raise DtypelabError(f"--baseline {opts.baseline}: not among the policies forecast "
                            f"({', '.join(p.name for p in plans)})")
    batch = opts.batch_size or task_obj.batch_size
    if batch % opts.nproc:
        raise DtypelabError(f"the batch size {batch} does not split over {opts.nproc} ranks: give --batch-size a "
                            f"multiple of {opts.nproc}")
    check_writable(opts.json_path)
    _targets_match(plans, task_obj)
    return plans


def _targets_match(plans: list[Plan], task_obj: Task) -> None:
    """--lora-targets checked against the whole model, built on the meta device, before anything is traced (a
    policy's trace sees a shallow copy of a deep model, and its failure would be one row's)."""
    lora = next((p.default for p in plans if isinstance(p.default, LoRA) and p.default.targets), None)
    if lora is None:
        return
    with torch.device("meta"), quiet():
        model = task_obj.make_model()
    lora.layout(model)


def _found(outcomes: list[Outcome], plans: list[Plan], interrupted: bool) -> tuple[int, dict[str, PolicyForecast]]:
    """(the parameters counted, each policy's forecast) from the workers' outcomes; a policy a dead worker took and
    did not report fails with its reason (or is marked interrupted)."""
    found: dict[str, PolicyForecast] = {}
    counted = 0
    for out in outcomes:
        if out.value is not None:
            counted, results = out.value
        else:  # the worker died or was stopped: what it had reported before stays
            results = [m[0] for k, m in out.messages.items() if k.startswith("policy:")]
            counted = counted or next(iter(out.messages.get("parameters", ())), 0)
        for result in results:
            found[result.policy] = result
    died = "; ".join(dict.fromkeys(out.reason or out.status for out in outcomes if out.status != "ok"))
    for plan in plans:
        found.setdefault(plan.name, PolicyForecast(plan.name, plan.describe(), "interrupted", reason=INTERRUPTED)
                         if interrupted else PolicyForecast(plan.name, plan.describe(), "failed",
                                                            reason=died or "not reported"))
    return counted, found


def _prestart(launcher: Launcher, target: Target) -> None:
    """Start the first worker's process early, with the forecast's modules and, for a Hugging Face model, the
    library's model code imported (about 8 s of a forecast's start on 2 cores, otherwise paid by this process and
    then by the worker, one after the other)."""
    if isinstance(launcher, ProcessLauncher):
        launcher.prestart((ForecastJob.__module__, *(HF_PRELOAD if target.spec.startswith(HF_PREFIX) else ())))


def _run_jobs(jobs: list[ForecastJob], launcher: Any, progress: Progress | None, total: int) -> tuple[list[Outcome],
                                                                                                     bool]:
    """Each job on its launcher (a zygote forks one worker at a time: parts after the first get a process launcher of
    their own), on the workers serving's forecast shares (``pool``); (outcomes, whether Ctrl-C stopped them)."""
    done = [0] * len(jobs)
    launchers = [launcher if i == 0 or not isinstance(launcher, ProcessLauncher) else ProcessLauncher()
                 for i in range(len(jobs))]

    def step(i: int, n: int) -> None:
        done[i] = n
        if progress is not None:
            progress(sum(done), total)

    if progress is not None:
        progress(0, total)
    cuda_guard_here()
    return run_parts(jobs, launchers, step)


def forecast(task: str | Task, options: ForecastOptions | None = None, *, progress: Progress | None = None,
             **settings: Any) -> ForecastReport:
    """Each policy's peak training memory (by category) and inference peak for ``task``, traced on fake tensors
    (nothing the size of the model is allocated), against ``device``'s memory: whether it fits, the headroom and the
    largest batch that fits. ``options`` (``ForecastOptions``) or its fields as keywords."""
    opts = ForecastOptions.build(options, **settings)
    start = time.monotonic()
    target = Target.of(with_seq_len(task, opts.seq_len))
    if target.is_script:
        raise DtypelabError(f"{target.spec} is a training script: forecast traces a task's step on fake tensors "
                            "(a built-in or FILE.py:make_task); a script runs as its own program (bench measures it)")
    device = target_device(opts.device, opts.memory, opts.reserve)
    measured = read_measured(opts.energy_from, device) if opts.energy_from else None  # its errors come first
    launcher = _launcher(opts.launcher, target)
    _prestart(launcher, target)  # the worker's imports run while this process reads the task
    task_obj = target.task()
    spec = target.spec
    plans = _checked(opts, target, device, task_obj)
    batch = opts.batch_size or task_obj.batch_size
    grouped = families(plans)
    hw = _hardware(device)
    rates, no_rates = rates_for(device) if opts.speed else (None, "--no-speed: memory alone, no time is forecast")
    # kernels timed here (this CPU's rates, --check's steps) are timed by one worker, with nothing beside it
    alone = opts.check or (rates is not None and rates.times_kernels)
    parts = 1 if getattr(launcher, "name", "") == "inline" or alone else worker_count(opts.workers, len(grouped))
    claims = tempfile.mkdtemp(prefix="dtypelab-forecast-") if parts > 1 else None
    ordered = tuple(p for group in grouped for p in group)
    jobs = [ForecastJob(spec, ordered, batch // opts.nproc, batch // opts.nproc, device.kind, opts.nproc, opts.seed,
                        device.usable_bytes, opts.batch_search, opts.check, "cuda" if device.kind == "cuda" else "cpu",
                        part=i, groups=tuple(map(len, grouped)), claims=claims, task=target.given, rates=rates)
            for i in range(parts)]
    try:
        outcomes, interrupted = _run_jobs(jobs, launcher, progress, len(plans))
    finally:
        if claims is not None:
            shutil.rmtree(claims, ignore_errors=True)
    counted, found = _found(outcomes, plans, interrupted)
    here = hw if device.kind == "cpu" and hw is not None else hardware_for(torch.device("cpu"), None, budget_s=0.02)
    results = [_placed(found[plan.name], plan, hw, device) for plan in plans]
    config = ForecastConfig(spec, task_obj.name, batch, opts.nproc, opts.seed, device,
                            parameters=counted, infer_batch_size=batch // opts.nproc,
                            mode="infer" if task_obj.inference_only else "train")
    report = _report(opts, config, results, task_obj, plans, rates, no_rates, measured, environment(here), start)
    if opts.json_path:
        report.save(opts.json_path)
    if interrupted:  # what finished is saved: the caller says so
        raise KeyboardInterrupt
    return report


def _placed(r: PolicyForecast, plan: Plan, hw: HardwareInfo | None, device: TargetDevice) -> PolicyForecast:
    """A policy's forecast with whether it runs on the target and, without a memory to fit, the smallest GPU."""
    avail = plan.availability(hw) if hw is not None and r.status == "ok" else None
    runs_there = "" if avail is None or avail.ok else avail.reason
    smallest = smallest_device(r, plan, parse_size(GPU_RESERVE)) if device.memory_bytes is None else None
    return PolicyForecast(**{**r.__dict__, "runs_there": runs_there, "smallest_device": smallest})


def _report(opts: ForecastOptions, config: ForecastConfig, results: list[PolicyForecast], task_obj: Task,
            plans: list[Plan], rates: Any, no_rates: str, measured: Any, env: dict[str, Any],
            start: float) -> ForecastReport:
    """The record: speedups against the baseline, energy, the answers in sentences, and the bands."""
    device, spec, batch = config.device, config.task, config.batch_size // config.nproc
    results, base = with_speedups(results, opts.baseline)
    power, no_power = target_power(device)
    results = with_energy(results, power, batch, tokens_per_step(task_obj, batch), measured)
    fastest, said = speed_answer(results, device, base, spec, rates, no_rates, {p.name: p for p in plans})
    return ForecastReport(config, tuple(results), env, answer(results, device),
                          notes=device_notes(device, opts.nproc), seconds=time.monotonic() - start,
                          created=time.strftime("%Y-%m-%dT%H:%M:%S"), baseline=base,
                          rates=rates.source if rates is not None else "", fastest=fastest, speed_answer=said,
                          speed_error=speedup_error(device) if rates is not None else 0.0,
                          energy_note=_energy_note(results, no_power), memory_error=memory_error(device),
                          energy_error=band("energy") if power is not None else 0.0,
                          step_error=band("train-tok-s") if rates is not None and device.kind == "cuda" else 0.0)


def _energy_note(results: list[PolicyForecast], no_power: str) -> str:
    """The power model each policy's energy comes from, or why there is none."""
    if not any(r.time is not None and r.time.step_s for r in results):
        return ""  # no time (--no-speed, no device): nothing to say of energy either
    return next((r.energy.by for r in results if r.energy is not None), "") or no_power


INTERRUPTED = "interrupted before it finished"
