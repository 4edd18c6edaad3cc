"""``bench()``: measure a task (or a training script) under each precision policy and return the judged record.

task → options → the plan of policies → the hardware probe → one job per policy, run by a launcher of
``dtypelab.run`` (a child process each by default; torchrun with --nproc) → interleaved timing rounds → the record,
judged (``core.judging``) and saved after every policy, so that an interruption keeps what finished.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtypelab.core.disturbance import was_disturbed
from dtypelab.core.energy import require_counter
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import (
    SLOW_RATIO,
    HardwareInfo,
    environment,
    hardware_for,
    probe_notice,
    resolve_device,
)
from dtypelab.core.measure import slow_base
from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.options import parse_size, training_objective
from dtypelab.core.policies import (
    BASELINE,
    Plan,
    baseline_policy,
    default_policies,
    get_policy,
    gpu_only_policies,
    parse_policies,
    policy_info,
    tuned,
)
from dtypelab.core.records import save_judged
from dtypelab.core.results import EnergySource, PolicyResult, Report, RunConfig
from dtypelab.core.task import Task
from dtypelab.core.tasks.hub import with_seq_len
from dtypelab.distributed import DistributedJob, torchrun_settings, with_scaling
from dtypelab.run import (
    Event,
    FanOutLauncher,
    OnEvent,
    Target,
    TorchrunLauncher,
)
from dtypelab.script import baseline_failed, bench_script
from dtypelab.sweep.budget import baseline_unneeded, budget_plan, over_budget, parse_budget
from dtypelab.sweep.interleave import interleaved
from dtypelab.sweep.job import Job
from dtypelab.sweep.options import BenchOptions
from dtypelab.sweep.places import FAN_OUT, ProbeWork, fanned, finished_before, launcher_for, remote_device
from dtypelab.sweep.plans import (
    DEFAULT_ROUNDS,
    DISTRIBUTED_DEFAULTS,
    INFER_STEPS,
    INFER_TIME_BOX_ROUNDS_S,
    INFER_TIME_BOX_S,
    MIN_TIMED,
    MORE_ROUNDS,
    check_patterns,
    emulate_here,
    policy_result,
    with_baselines,
)
from dtypelab.sweep.rounds import RoundsJob


def bench(task: str | Task, policies: Any = None, options: BenchOptions | None = None, *,
          on_event: OnEvent | None = None, **settings: Any) -> Report:
    """Train (or run inference on) ``task`` under each policy and measure speed, memory and metric; return the
    record, with its decision in ``record.recommendation``.

    ``options`` (a ``BenchOptions``) and keyword ``settings`` (its fields, given over it) say what to do: see
    ``BenchOptions`` for every one (policies, mode, steps, tolerance, rounds, budget, nproc, …). ``policies``:
    names, plan files (``.json``), configs or plans, or a comma-separated string; None means every registered
    policy that applies, those that cannot run here recorded as skipped. ``task`` may be a training script (a ``.py``
    file without ``make_task``, see ``dtypelab.session``): it runs once per policy with ``script_args``."""
    if "isolate" in settings:  # the launcher's older spelling
        settings.setdefault("launcher", "process" if settings.pop("isolate") else "inline")
    opts = BenchOptions.build(options, **({"policies": policies} if policies is not None else {}), **settings)
    target = Target.of(with_seq_len(task, opts.seq_len))
    on_event = on_event or (lambda e: None)
    fanned = opts.launcher in FAN_OUT or isinstance(opts.launcher, FanOutLauncher)
    if objective_of(opts.objective).counts_joules and not fanned:
        require_counter(resolve_device(opts.device))  # refused before the sweep, not after it
    if target.is_script:
        if opts.launcher in FAN_OUT or isinstance(opts.launcher, FanOutLauncher):
            raise DtypelabError(f"--launcher {getattr(opts.launcher, 'kind', opts.launcher)}: a training script runs "
                                "as its own program, one policy after another; fan-out takes a task "
                                "(FILE.py:make_task)")
        return bench_script(target, opts, on_event)
    if opts.script_args:
        raise DtypelabError(f"script_args: arguments after -- are for a training script; {target.spec} is a task")
    return _Sweep(target, opts, on_event).run()


@dataclass
class _Sweep:
    target: Target
    opts: BenchOptions
    on_event: OnEvent

    def __post_init__(self) -> None:
        opts = self.opts
        self.started = time.monotonic()
        self.torchrun, self.links = (torchrun_settings(
            opts.nproc, opts.nnodes, opts.rdzv_endpoint, opts.torchrun_args, opts.link_gbps, mode=opts.mode,
            per_layer=opts.per_layer, profile=bool(opts.profile_steps), rounds=opts.rounds, launcher=opts.launcher)
            if opts.nproc is not None else (None, ()))
        self.launcher = launcher_for(opts, task_object=True) if self.target.given is not None else (
            TorchrunLauncher(self.torchrun) if self.torchrun else launcher_for(opts))
        self.fans_out = bool(getattr(self.launcher, "parallel", False))
        self.remote = getattr(self.launcher, "kind", "") == "slurm"  # the runs' device is on the cluster's nodes
        self.budget_s = parse_budget(opts.budget)
        self.explicit = opts.policies is not None
        self.baseline = baseline_policy(opts.baseline).name if opts.baseline else BASELINE
        self.dev = remote_device(opts.device) if self.remote else resolve_device(opts.device)
        defaults = DISTRIBUTED_DEFAULTS if self.torchrun else default_policies(opts.mode, self.dev.type)
        plans = {p.name: p for p in (parse_policies(opts.policies) if self.explicit else map(get_policy, defaults))}
        if opts.emulate:  # what cannot run here runs emulated: named ones in place, or all of them besides a default
            plans = emulate_here(plans, self.explicit, opts.mode, self.dev)
        self.added = {p.name: p for p in parse_policies(opts.plan)} if opts.plan else {}
        plans.update(self.added)
        plans = {p.name: p for p in tuned(plans.values(), opts)}
        if self.torchrun is None and any(p.distributed for p in plans.values()):
            raise DtypelabError(f"{next(n for n, p in plans.items() if p.distributed)} runs across processes: give "
                                "--nproc N")
        for named in plans.values() if self.explicit else self.added.values():
            wrong_mode = named.mode_error(opts.mode)
            if wrong_mode:
                raise DtypelabError(wrong_mode)
        self.task = self.target.task()  # fail here, once, on a broken task, before any child starts
        if opts.mode == "train" and self.task.inference_only:
            raise DtypelabError(f"task {self.task.name} is inference-only: use --mode infer")
        check_patterns(self.task, plans.values())
        if self.fans_out and self.dev.type == "cuda":  # each job sees its own GPU(s) only, as cuda:0
            self.dev = torch.device("cuda")
        if self.torchrun and self.dev.type == "cuda" and self.torchrun.nproc > torch.cuda.device_count():
            raise DtypelabError(f"--nproc {self.torchrun.nproc} on CUDA needs one GPU per rank; this node has "
                                f"{torch.cuda.device_count()}")
        self.plans = with_baselines(plans, self.explicit, self.baseline)

    def _settings(self) -> tuple[int, int, int, float | None, int, int]:
        """(steps, batch size, warm-up, inference time box, rounds, block) from the options and the task."""
        opts, task = self.opts, self.task
        # A pretrained task is never trained: its steps are forward passes, sized for its (larger) model.
        steps = opts.steps or (INFER_STEPS if opts.mode == "infer" and not task.pretrained else task.steps)
        warmup = max(1, min(10, steps // 10)) if opts.warmup is None else opts.warmup
        if warmup >= steps:
            raise DtypelabError(f"--warmup ({warmup}) must be smaller than --steps ({steps})")
        rounds = 0 if self.torchrun else DEFAULT_ROUNDS[opts.mode] if opts.rounds is None else opts.rounds
        time_box = (INFER_TIME_BOX_ROUNDS_S if rounds else INFER_TIME_BOX_S) \
            if opts.mode == "infer" and opts.steps is None else None
        # Blocks long enough for a median, short enough that the rounds cost a fraction of the learning runs.
        block = 0 if not rounds else (max(5, min(30, steps // (2 * rounds))) if opts.mode == "train"
                                      else max(2, min(10, steps // (2 * rounds))))
        return steps, opts.batch_size or task.batch_size, warmup, time_box, rounds, block

    def run(self) -> Report:
        opts, on_event = self.opts, self.on_event
        steps, batch_size, warmup, time_box, rounds, block = self._settings()
        objective = _objective(opts.objective, rounds)
        if opts.hardware is None:
            on_event(Event("probe", "", label="probing hardware" + (" on a node" if self.remote else "")))
        hardware = self._probe() if self.remote and opts.hardware is None else hardware_for(self.dev, opts.hardware)
        order = list(self.plans)
        config = RunConfig(
            task=self.target.spec, mode=opts.mode, policies=tuple(order), steps=steps, batch_size=batch_size,
            warmup=warmup, seed=opts.seed, tolerance=opts.tolerance, device=str(self.dev), force=opts.force,
            timeout_s=opts.timeout_s, metric=self.task.metric, higher_is_better=self.task.higher_is_better,
            threads=opts.threads, per_layer=opts.per_layer, min_cosine=opts.min_cosine, task_name=self.task.name,
            time_box_s=time_box, rounds=rounds, rounds_block=block, profile_steps=opts.profile_steps,
            nproc=self.torchrun.nproc if self.torchrun else 0, nnodes=opts.nnodes,
            link_gbps=tuple(g for _, g in self.links), memory_budget_bytes=parse_size(opts.memory_budget),
            baseline=self.baseline, objective=objective)
        report = Report(config, environment(hardware), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        runnable = self._runnable(hardware)
        for name in order:
            if name not in runnable:
                avail = self.plans[name].availability(hardware)
                report = report.with_result(PolicyResult(name, "skipped", avail.reason,
                                                         info=policy_info(self.plans[name]),
                                                         skip="slow" if avail.ok else "unsupported"))
        kept = finished_before(opts, config, report.environment)
        if kept:
            for result in kept.values():
                report = report.with_result(result)
            runnable = [n for n in runnable if n not in kept]
            on_event(Event("notice", "", label=f"kept {len(kept)} finished run(s) of the interrupted sweep in "
                                               f"{opts.json_path} ({', '.join(kept)}); measuring fp32 again (the "
                                               "others' yardstick) and the rest (--fresh: all)"))
        report = save_judged(report, opts.json_path)
        left_gpu = [] if self.explicit or self.torchrun or self.dev.type != "cpu" else gpu_only_policies(opts.mode)
        if left_gpu:
            on_event(Event("notice", "", label=f"GPU-only policies not in a CPU sweep: {', '.join(left_gpu)} "
                                               "(`dtypelab policies` says what each needs)"))
        if probe_notice(hardware) and not opts.force:  # said once every option is known good: errors stay one line
            on_event(Event("notice", "", label=probe_notice(hardware)))
        if self.fans_out:  # the runs share their initial weights and reference outputs through this folder
            os.makedirs(self.launcher.folder, exist_ok=True)  # type: ignore[attr-defined]
        with tempfile.TemporaryDirectory(prefix="dtypelab-", dir=self.launcher.folder if self.fans_out  # type: ignore[attr-defined]
                                         else None) as workdir:
            report = self._policies(report, runnable, hardware, workdir)
            if self.torchrun is not None:
                report = save_judged(with_scaling(report, self.links), opts.json_path)
            if rounds:
                weights = None if opts.mode == "infer" and self.task.pretrained else os.path.join(
                    workdir, "reference.pt" if opts.mode == "infer" else "init.pt")
                job = RoundsJob(self.target.spec, (), opts.mode, rounds, block, batch_size, opts.seed, str(self.dev),
                                weights, opts.threads, workdir=workdir, max_rounds=MORE_ROUNDS * rounds,
                                given=self.target.given)
                report = interleaved(self.launcher, self.plans, opts, self.on_event, report, job)
            else:  # energy is read in the rounds' windows: the record says why it holds none
                report = save_judged(replace(report, energy_source=EnergySource(why=(
                    "energy is measured in the interleaved rounds' windows, and this sweep had none"
                    f"{' (torchrun)' if self.torchrun else ' (--rounds 0)'}"))), opts.json_path)
        return report

    def _probe(self) -> HardwareInfo:
        out = self.launcher.run(ProbeWork(str(self.dev)), self.opts.timeout_s, lambda d, t: None)
        if not out.ok or not isinstance(out.value, HardwareInfo):
            raise DtypelabError(f"the hardware probe on the cluster did not finish ({out.status}: {out.reason})")
        return out.value

    def _runnable(self, hardware: HardwareInfo) -> list[str]:
        """The policies that run here, the baseline first; naming one that cannot is an error."""
        runnable = []
        for name in [BASELINE] + [n for n in self.plans if n != BASELINE]:
            avail = self.plans[name].availability(hardware)
            if not avail.ok and (self.explicit or name in self.added or name == self.baseline):
                raise DtypelabError(f"policy {name} cannot run here: {avail.reason}")
            if name == self.baseline != BASELINE and avail.slow and not self.opts.force:
                raise DtypelabError(f"the baseline {name} is measured too slow here ({avail.reason}); --force runs "
                                    "it anyway")
            if avail.ok and not (avail.slow and not self.opts.force):
                runnable.append(name)
        return runnable

    def _job(self, plan: Plan, mode: str, steps: int, workdir: str, hardware: HardwareInfo,
             base_step: tuple[float, float] | None) -> Job | DistributedJob:
        opts = self.opts
        _, batch_size, warmup, time_box, _, _ = self._settings()
        if self.torchrun is not None:
            return DistributedJob(self.target.spec, plan, steps, batch_size, warmup, opts.seed, str(self.dev),
                                  workdir, opts.threads, opts.nnodes, opts.timeout_s)
        watch = mode == opts.mode and plan.name != BASELINE and base_step is not None and not opts.force
        step, span = base_step if base_step is not None else (None, 0.0)
        return Job(self.target.spec, plan, mode, steps, batch_size, warmup, opts.seed, str(self.dev), workdir,
                   opts.threads, given=self.target.given, per_layer=opts.per_layer and mode == "infer",
                   time_box_s=time_box if mode == "infer" else None, min_timed=MIN_TIMED,
                   slow_step_s=step / SLOW_RATIO if watch and step else None, baseline_step_s=step,
                   slow_span_s=span,
                   profile_steps=opts.profile_steps if mode == opts.mode else 0, peaks=hardware.gflops,
                   rated=hardware.rated_tflops, trace_dir=os.path.abspath(opts.trace_dir) if opts.trace_dir else None)

    def _measure(self, plan: Plan, mode: str, steps: int, workdir: str, hardware: HardwareInfo,
                 base_step: tuple[float, float] | None) -> PolicyResult:
        job = self._job(plan, mode, steps, workdir, hardware, base_step)
        out = self.launcher.run(job, self.opts.timeout_s,
                                lambda d, t: self.on_event(Event("step", plan.name, d, t)))
        return policy_result(out, plan)

    def _policies(self, report: Report, runnable: list[str], hardware: HardwareInfo, workdir: str) -> Report:
        """Each runnable policy's learning run, fp32 first; the record saved after each."""
        opts, on_event, plans = self.opts, self.on_event, self.plans
        steps = report.config.steps
        if opts.mode == "infer" and not self.task.pretrained:
            on_event(Event("start", BASELINE, 0, self.task.steps, label="training fp32 reference"))
            ref = self._measure(plans[BASELINE], "reference", self.task.steps, workdir, hardware, None)
            on_event(Event("done", BASELINE, result=ref, label="training fp32 reference"))
            if ref.status != "ok":
                raise DtypelabError(f"training the fp32 reference for inference failed: {ref.status}: {ref.reason}")
        pending = list(runnable)
        base_wall: float | None = None
        # fp32's step in this sweep and the span to judge over (core.measure.slow_base): runs 10x slower stop early
        base_step: tuple[float, float] | None = None
        try:
            while pending:
                name = pending[0]
                elapsed = time.monotonic() - self.started
                over = over_budget(plans[name], hardware, base_wall, self.budget_s, elapsed) or baseline_unneeded(
                    [plans[n] for n in pending], hardware, base_wall, self.budget_s, elapsed)
                if over:
                    result = PolicyResult(name, "skipped", over, info=policy_info(plans[name]), skip="budget")
                else:
                    on_event(Event("start", name, 0, steps))
                    result = self._measure(plans[name], opts.mode, steps, workdir, hardware, base_step)
                if name == BASELINE:
                    base_wall = result.wall_s
                    # a disturbed fp32 median would set the slow check's bar by noise: its fastest step does not
                    base_step = slow_base(result.step_times_s, result.warmup, was_disturbed(result.disturbance)) \
                        if result.status == "ok" else None
                pending.pop(0)
                # on disk before anyone hears of it: Ctrl-C in a handler loses nothing
                report = save_judged(report.with_result(result), opts.json_path)
                on_event(Event("skip" if over else "done", name, result=result))
                if name == BASELINE and result.status != "ok" and not opts.keep_going:
                    report = save_judged(baseline_failed(report, {n: plans[n] for n in pending}, result),
                                         opts.json_path)
                    pending.clear()
                    break
                if name == BASELINE and self.fans_out and pending:
                    jobs = [self._job(plans[n], opts.mode, steps, workdir, hardware, base_step) for n in pending]
                    report = fanned(report, jobs, pending, steps, self.launcher, opts, self.on_event)
                elif name == BASELINE and self.budget_s is not None and pending:
                    on_event(Event("notice", "", label=budget_plan([plans[n] for n in pending], hardware, base_wall,
                                                                    self.budget_s, time.monotonic() - self.started)))
        except KeyboardInterrupt:
            for name in pending:
                report = report.with_result(PolicyResult(name, "interrupted", "interrupted before it finished",
                                                         info=policy_info(plans[name])))
            save_judged(report, opts.json_path)
            raise
        return report


def _objective(objective: str | None, rounds: int) -> str:
    """What training and inference choose for: speed, or energy (measured in the interleaved rounds' windows)."""
    objective = training_objective(objective)
    if objective_of(objective).counts_joules and not rounds:
        raise DtypelabError("--objective energy needs the interleaved rounds, whose windows the energy counter "
                            "measures: leave out --rounds 0 (and --nproc, whose runs have no rounds)")
    return objective
