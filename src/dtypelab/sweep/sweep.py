"""The public entry point: measure a task under each precision policy and return a Report."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from dtypelab.core.disturbance import was_disturbed
from dtypelab.core.errors import DtypelabError
from dtypelab.core.hardware import (
    SLOW_RATIO,
    HardwareInfo,
    environment,
    hardware_for,
    probe_notice,
    resolve_device,
)
from dtypelab.core.judging import Tolerance
from dtypelab.core.policies import (
    BASELINE,
    COMPILED_BASELINE,
    Config,
    Plan,
    default_policies,
    get_policy,
    parse_policies,
    policy_info,
)
from dtypelab.core.records import save_judged
from dtypelab.core.results import PolicyResult, Report, RunConfig
from dtypelab.core.task import Task, is_script, load_task
from dtypelab.profiling.run import PROFILE_STEPS
from dtypelab.sweep.budget import DEFAULT_BUDGET_S, budget_plan, over_budget, parse_budget
from dtypelab.sweep.job import Job
from dtypelab.sweep.launch import LAUNCHERS, Event, Launcher, OnEvent
from dtypelab.sweep.rounds import RoundsJob, RoundsResult, paired_speedup

MODES = ("train", "infer")
INFER_STEPS = 50
# With the default step count, inference timing stops after this many seconds of timed passes (and at least
# MIN_TIMED passes after warm-up): on a CPU where one pass of a real model takes 2 s, 50 passes per policy
# would be most of a sweep's time and add nothing to a median. --steps N always times exactly N.
INFER_TIME_BOX_S = 8.0
MIN_TIMED = 4
DEFAULT_ROUNDS = {"train": 5, "infer": 3}
# --nproc without --policies: plain DDP (the baseline), each gradient compression, FSDP2 with and without bf16
DISTRIBUTED_DEFAULTS = ("fp32", "fp32+ddp-fp16", "fp32+ddp-bf16", "fp32+ddp-powersgd", "fp32+fsdp",
                        "fp32+fsdp-bf16-params-fp32-reduce")


def _check_patterns(task: Task, plans: Iterable[Plan]) -> None:
    """A plan pattern that names no module of the task's model is an error before any child starts. A model
    whose factory raises is left to the jobs, which report the user's line."""
    ruled = [p for p in plans if p.rules]
    if not ruled:
        return
    try:
        model = task.make_model()
    except Exception:
        return
    for plan in ruled:
        plan.assign(model)


def _hardware(dev: torch.device, given: HardwareInfo | str | None, on_event: OnEvent) -> HardwareInfo:
    if given is None:
        on_event(Event("probe", "", label="probing hardware"))
    return hardware_for(dev, given)


def _with_baselines(plans: dict[str, Plan], explicit: bool) -> dict[str, Plan]:
    """Table order: the registry's for a default sweep, else the user's with the baseline added first; compiled
    fp32 beside any compiled policy, whose speed means little against eager fp32 alone."""
    if BASELINE not in plans or explicit:
        plans = {BASELINE: get_policy(BASELINE), **plans}
    if any(p.compiles for p in plans.values()) and COMPILED_BASELINE not in plans:
        plans = {BASELINE: plans[BASELINE], COMPILED_BASELINE: get_policy(COMPILED_BASELINE),
                 **{k: v for k, v in plans.items() if k != BASELINE}}
    return plans


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise DtypelabError(f"--{name} must be a positive integer, got {value}")


def bench(
    task: str,
    policies: str | Sequence[str | Config | Plan] | None = None,
    *,
    mode: str = "train",
    steps: int | None = None,
    batch_size: int | None = None,
    warmup: int | None = None,
    tolerance: str = "1%",
    device: str | None = None,
    seed: int = 0,
    force: bool = False,
    timeout_s: float = 600.0,
    threads: int | None = None,
    json_path: str | None = None,
    per_layer: bool = False,
    min_cosine: float = 0.99,
    isolate: bool = True,
    launcher: str | Launcher | None = None,
    on_event: OnEvent | None = None,
    hardware: HardwareInfo | str | None = None,
    budget: str | float | None = DEFAULT_BUDGET_S,
    rounds: int | None = None,
    profile: bool | int = False,
    trace_dir: str | None = None,
    script_args: Sequence[str] = (),
    nproc: int | None = None,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    torchrun_args: str | Sequence[str] | None = None,
    link_gbps: str | Sequence[str | float] | None = None,
    plan: str | Sequence[str | Plan] | None = None,
) -> Report:
    """Train (or run inference on) ``task`` under each policy and measure speed, memory and metric.

    ``policies``: names, plan files (``.json``), configs or plans, or a comma-separated string of names
    and plan files; None means every registered policy, with those that cannot run here recorded as
    skipped. Naming one that cannot run here is an error. Policies measured to be pathologically slow
    here are skipped unless ``force``. Each policy runs in its own process (``launcher="process"``, the
    default; ``"inline"`` or ``isolate=False`` runs it in this one) under a ``timeout_s`` limit; the
    report is rewritten to ``json_path`` after each one, so an interruption keeps what finished.
    ``per_layer`` (infer mode): also the SQNR of every layer's output vs the fp32 model. ``min_cosine``
    (infer mode): a policy whose worst per-sample output cosine vs fp32 falls below it is not
    recommended, whatever its metric. ``budget`` (seconds, or text such as "15m"; None or 0: none): after the
    fp32 run, each further policy's time is estimated from fp32's and the probe, and one that would not fit
    in what is left of the budget is recorded as skipped with its estimate. ``rounds`` (default: 5 in
    training, 3 in inference; 0: off): after the learning runs, the policies that finished are timed again
    round-robin in one process, and each speedup comes from paired rounds with a 95% interval (see
    ``bench.rounds``). ``profile`` (True, or a number of steps): after each policy's measurement, a few steps
    more are profiled (``dtypelab.profile``): step breakdown, top ops, achieved FLOP/s, dtype coverage; the
    profiler's cost never enters the measured times. ``trace_dir`` also writes each policy's Chrome trace there
    (and implies ``profile``).

    ``plan``: plan files (or plans) measured beside ``policies`` (or beside the default set when ``policies`` is
    None), e.g. what ``dtypelab tune -o plan.json`` wrote.

    ``task`` may also be a training script (a ``.py`` file without ``make_task``, see ``dtypelab.session``): it is
    run once per policy with ``script_args``, and measured the same way (``dtypelab.script.bench_script``).

    ``nproc`` (training only): every policy runs under torchrun on ``nproc`` ranks per node (gloo on CPU, NCCL on
    CUDA), each rank on its slice of the same global batch; a policy may carry a distributed modifier
    (``fp32+ddp-fp16``, ``fp32+fsdp-bf16-params-fp32-reduce``, see ``core.policies.distributed``), and one
    without runs as plain DDP. ``nnodes``, ``rdzv_endpoint`` and ``torchrun_args`` go to torchrun unchanged.
    The record gets bytes per step, communication and per-rank memory, and a scaling estimate for the links in
    ``link_gbps`` (``dtypelab.distributed``).
    """
    from dtypelab.script.runner import bench_script

    if is_script(task):
        unsupported = [flag for flag, given in (("--mode infer", mode != "train"), ("--steps", steps is not None),
                                                ("--batch-size", batch_size is not None), ("--warmup", warmup),
                                                ("--per-layer", per_layer), ("--profile", profile or trace_dir),
                                                ("--threads", threads), ("--rounds", rounds),
                                                ("--plan (name the plan file in --policies)", plan),
                                                ("--nproc", nproc is not None)) if given]
        if unsupported:
            raise DtypelabError(f"{', '.join(unsupported)}: not for a training script, which runs its own loop (pass "
                                "its own arguments after --)")
        return bench_script(task, policies, args=script_args, tolerance=tolerance, device=device, seed=seed,
                            force=force, timeout_s=timeout_s, json_path=json_path, on_event=on_event,
                            hardware=hardware)
    if script_args:
        raise DtypelabError(f"arguments after -- are for a training script; {task} is a task")
    torchrun, links = None, ()
    if nproc is not None or nnodes != 1 or rdzv_endpoint or torchrun_args or link_gbps:
        from dtypelab.distributed.launch import check_options

        torchrun, links = check_options(nproc, nnodes, rdzv_endpoint, torchrun_args, link_gbps, mode=mode,
                                        per_layer=per_layer, profile=bool(profile or trace_dir), rounds=rounds,
                                        launcher=launcher)
        launcher, rounds = torchrun.launcher(), 0
    started = time.monotonic()
    if mode not in MODES:
        raise DtypelabError(f"unknown mode {mode!r}: use train or infer")
    for name, value in (("steps", steps), ("batch-size", batch_size), ("threads", threads)):
        _positive(name, value)
    if warmup is not None and warmup < 0:
        raise DtypelabError(f"--warmup must be >= 0, got {warmup}")
    if timeout_s <= 0:
        raise DtypelabError(f"--timeout must be positive, got {timeout_s:g}")
    if rounds is not None and (rounds < 0 or rounds == 1):  # checked before the probe: one line, nothing else
        raise DtypelabError(f"--rounds must be 0 (off) or at least 2 (an interval needs two pairs), got {rounds}")
    profile_steps = PROFILE_STEPS if profile is True or (trace_dir and not profile) else int(profile)
    if profile_steps < 0:
        raise DtypelabError(f"--profile steps must be positive, got {profile_steps}")
    tol = Tolerance.parse(tolerance)
    budget_s = parse_budget(budget)
    explicit = policies is not None
    defaults = DISTRIBUTED_DEFAULTS if torchrun is not None else default_policies(mode)
    plans = {p.name: p for p in (parse_policies(policies) if explicit else map(get_policy, defaults))}
    added = {p.name: p for p in parse_policies(plan)} if plan else {}
    plans.update(added)
    if torchrun is None and any(p.distributed for p in plans.values()):
        raise DtypelabError(f"{next(n for n, p in plans.items() if p.distributed)} runs across processes: give "
                            "--nproc N")
    if launcher is None:
        launcher = "process" if isolate else "inline"
    if isinstance(launcher, str):
        if launcher not in LAUNCHERS:
            raise DtypelabError(f"unknown launcher {launcher!r}: use {', '.join(LAUNCHERS)}")
        launcher = LAUNCHERS[launcher]
    if not 0 <= min_cosine <= 1:
        raise DtypelabError(f"--min-cosine must be between 0 and 1, got {min_cosine:g}")
    if per_layer and mode != "infer":
        raise DtypelabError("--per-layer compares inference outputs: use it with --mode infer")
    for named in plans.values() if explicit else added.values():
        wrong_mode = named.mode_error(mode)
        if wrong_mode:
            raise DtypelabError(wrong_mode)
    loaded = load_task(task)  # fail here, once, on a broken task, before any child starts
    if mode == "train" and loaded.inference_only:
        raise DtypelabError(f"task {loaded.name} is inference-only: use --mode infer")
    _check_patterns(loaded, plans.values())
    dev = resolve_device(device)
    if torchrun is not None and dev.type == "cuda" and torchrun.nproc > torch.cuda.device_count():
        raise DtypelabError(f"--nproc {torchrun.nproc} on CUDA needs one GPU per rank; this node has "
                            f"{torch.cuda.device_count()}")
    on_event = on_event or (lambda e: None)
    hardware = _hardware(dev, hardware, on_event)

    # A pretrained task is never trained: its steps are forward passes, sized for its (larger) model.
    time_box = INFER_TIME_BOX_S if mode == "infer" and steps is None else None
    steps = steps or (INFER_STEPS if mode == "infer" and not loaded.pretrained else loaded.steps)
    batch_size = batch_size or loaded.batch_size
    if warmup is None:
        warmup = max(1, min(10, steps // 10))
    if warmup >= steps:
        raise DtypelabError(f"--warmup ({warmup}) must be smaller than --steps ({steps})")
    rounds = DEFAULT_ROUNDS[mode] if rounds is None else rounds
    # Blocks long enough for a median, short enough that the rounds cost a fraction of the learning runs.
    block = 0 if not rounds else (max(5, min(30, steps // (2 * rounds))) if mode == "train"
                                  else max(2, min(10, steps // (2 * rounds))))
    plans = _with_baselines(plans, explicit)
    order = list(plans)
    config = RunConfig(
        task=task, mode=mode, policies=tuple(order), steps=steps, batch_size=batch_size, warmup=warmup,
        seed=seed, tolerance=str(tol), device=str(dev), force=force, timeout_s=timeout_s,
        metric=loaded.metric, higher_is_better=loaded.higher_is_better, threads=threads, per_layer=per_layer,
        min_cosine=min_cosine, task_name=loaded.name, time_box_s=time_box, rounds=rounds, rounds_block=block,
        profile_steps=profile_steps, nproc=torchrun.nproc if torchrun else 0, nnodes=nnodes,
        link_gbps=tuple(g for _, g in links),
    )
    report = Report(config, environment(hardware), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    runnable: list[str] = []
    for name in [BASELINE] + [n for n in order if n != BASELINE]:  # the baseline always runs first
        avail = plans[name].availability(hardware)
        if not avail.ok and (explicit or name in added):
            raise DtypelabError(f"policy {name} cannot run here: {avail.reason}")
        if not avail.ok or (avail.slow and not force):
            report = report.with_result(PolicyResult(name, "skipped", avail.reason, info=policy_info(plans[name]),
                                                     skip="slow" if avail.ok else "unsupported"))
        else:
            runnable.append(name)
    report = save_judged(report, json_path)
    if probe_notice(hardware) and not force:  # said once every option is known good: an error stays one line
        on_event(Event("notice", "", label=probe_notice(hardware)))

    with tempfile.TemporaryDirectory(prefix="dtypelab-") as workdir:
        base_step: float | None = None  # fp32's median step in this sweep: later runs 10x slower stop early

        def run(policy: str, job_mode: str, job_steps: int) -> PolicyResult:
            watch = job_mode == mode and policy != BASELINE and base_step is not None and not force
            job = Job(task, plans[policy], job_mode, job_steps, batch_size, warmup, seed, str(dev), workdir, threads,
                      per_layer=per_layer and job_mode == "infer",
                      time_box_s=time_box if job_mode == "infer" else None, min_timed=MIN_TIMED,
                      slow_step_s=base_step / SLOW_RATIO if watch else None, baseline_step_s=base_step,
                      profile_steps=profile_steps if job_mode == mode else 0, peaks=hardware.gflops,
                      trace_dir=os.path.abspath(trace_dir) if trace_dir else None)
            result = launcher.run(job, timeout_s, lambda d, t: on_event(Event("step", policy, d, t)))
            return result if result.info else replace(result, info=policy_info(job.plan))  # died before saying

        if mode == "infer" and not loaded.pretrained:
            on_event(Event("start", BASELINE, 0, loaded.steps, label="training fp32 reference"))
            ref = run(BASELINE, "reference", loaded.steps)
            on_event(Event("done", BASELINE, result=ref, label="training fp32 reference"))
            if ref.status != "ok":
                raise DtypelabError(f"training the fp32 reference for inference failed: {ref.status}: {ref.reason}")
        pending = list(runnable)
        base_wall: float | None = None
        try:
            while pending:
                name = pending[0]
                over = over_budget(plans[name], hardware, base_wall, budget_s, time.monotonic() - started)
                if over:
                    result = PolicyResult(name, "skipped", over, info=policy_info(plans[name]), skip="budget")
                else:
                    on_event(Event("start", name, 0, steps))
                    result = run(name, mode, steps)
                if name == BASELINE:
                    base_wall = result.wall_s
                    # fp32's median under disturbance would make every later policy look 10x slower
                    quiet = not was_disturbed(result.disturbance)
                    base_step = result.timing.median if result.status == "ok" and result.timing and quiet else None
                report = report.with_result(result)
                pending.pop(0)
                # on disk before anyone hears of it: Ctrl-C in a handler loses nothing
                report = save_judged(report, json_path)
                on_event(Event("skip" if over else "done", name, result=result))
                if name == BASELINE and budget_s is not None and pending:
                    on_event(Event("notice", "", label=budget_plan([plans[n] for n in pending], hardware, base_wall,
                                                                    budget_s, time.monotonic() - started)))
        except KeyboardInterrupt:
            for name in pending:
                report = report.with_result(PolicyResult(name, "interrupted", "interrupted before it finished",
                                                         info=policy_info(plans[name])))
            report = save_judged(report, json_path)
            raise
        if torchrun is not None:
            from dtypelab.distributed.scaling import with_scaling

            report = with_scaling(report, links)
            report = save_judged(report, json_path)
        if rounds:
            report = _interleaved(report, loaded, plans, launcher, on_event, json_path, timeout_s, RoundsJob(
                task, (), mode, rounds, block, batch_size, seed, str(dev),
                None if mode == "infer" and loaded.pretrained else os.path.join(
                    workdir, "reference.pt" if mode == "infer" else "init.pt"), threads, workdir=workdir))
    return report


def _interleaved(report: Report, task: Task, plans: dict[str, Plan], launcher: Launcher, on_event: OnEvent,
                 json_path: str | None, timeout_s: float, job: RoundsJob) -> Report:
    """The speed phase: the policies that ran to the end are timed again in interleaved rounds, in one process,
    and each gets its paired speedup and interval. A failure here keeps the learning runs' own timings."""
    names = [r.policy for r in report.results if r.status == "ok" and r.timing]
    if BASELINE not in names or len(names) < 2:
        return report
    job = replace(job, plans=tuple(plans[n] for n in names))
    label = f"timing in {job.rounds} interleaved rounds of {job.block} steps"
    on_event(Event("start", "rounds", 0, job.rounds * len(names), label=label))
    result = launcher.run(job, timeout_s, lambda d, t: on_event(Event("step", "rounds", d, t)))
    on_event(Event("end", "rounds", result=result, label=label))
    if not isinstance(result, RoundsResult) or result.status != "ok" or not result.blocks:
        on_event(Event("notice", "", label=f"interleaved timing gave no rounds ({result.status}"
                                            f"{': ' + result.reason if result.reason else ''}); speeds come from "
                                            "each policy's own run"))
        return report
    base, compiled = result.blocks[BASELINE], result.blocks.get(COMPILED_BASELINE)
    for name in names:
        r = report.result(name)
        blocks = result.blocks.get(name, ())
        fair = paired_speedup(compiled, blocks) if compiled and plans[name].compiles and name != COMPILED_BASELINE \
            else None
        report = report.with_result(replace(r, rounds=blocks, compiled_ci=fair,
                                            speedup_ci=None if name == BASELINE else paired_speedup(base, blocks)))
    report = save_judged(report, json_path)
    return report
