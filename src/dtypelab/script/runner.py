"""``dtypelab bench train.py [-- args]``: the user's own script, run once per policy, each in its own process by
``dtypelab.run``'s script launcher. Its ``dtypelab.session()`` (or a framework integration) connects to the launcher,
is sent its job (the policy; a diagnosis for ``trace`` / ``audit``) and sends back what it measured. A crash, a hang
or a script that never calls ``finish`` becomes a result that says so; the other policies still run.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from dtypelab.core.disturbance import was_disturbed
from dtypelab.core.energy import counter_of
from dtypelab.core.errors import DtypelabError
from dtypelab.core.loop import DIVERGED_PATIENCE
from dtypelab.core.machine.hardware import SLOW_RATIO, environment, hardware_for, probe_notice, resolve_device
from dtypelab.core.measure import slow_base
from dtypelab.core.options import parse_duration, training_objective
from dtypelab.core.policies import (
    BASELINE,
    Plan,
    baseline_policy,
    default_policies,
    get_policy,
    parse_policies,
    policy_info,
    tuned,
)
from dtypelab.core.records import save_judged
from dtypelab.core.results import EnergySource, PolicyResult, Report, RunConfig
from dtypelab.core.tolerance import Tolerance
from dtypelab.lint import lint_paths
from dtypelab.run import Event, Note, OnEvent, Outcome, ScriptLauncher, ScriptRun, Target, imported_modules
from dtypelab.script.adapters import trainer_arguments
from dtypelab.script.diagnose import Diagnosis
from dtypelab.script.messages import ScriptJob
from dtypelab.script.repeats import repeat_runs
from dtypelab.script.results import FLOAT64_NOTE, Primary, script_result


class ScriptOptions(Protocol):
    """What a script's sweep reads of bench's options (a ``BenchOptions``: sweep imports this package, not the
    reverse)."""

    policies: Any
    baseline: str | None
    budget: Any
    device: str | None
    force: bool
    hardware: Any
    json_path: str | None
    keep_going: bool
    script_args: tuple[str, ...]
    seed: int
    timeout_s: float
    tolerance: str

    @property
    def model_fields_set(self) -> set[str]: ...


# Options of a Task's own loop: a script runs its own (its arguments go after --)
LOOP_OPTIONS = {"mode": "--mode infer", "steps": "--steps", "batch_size": "--batch-size", "warmup": "--warmup",
                "per_layer": "--per-layer", "profile": "--profile", "trace_dir": "--profile", "threads": "--threads",
                "rounds": "--rounds", "plan": "--plan (name the plan file in --policies)", "nproc": "--nproc"}
def job_for(path: str, plan: Plan, seed: int, device: str, mode: str = "bench", diagnosis: Diagnosis | None = None,
            **extra: Any) -> ScriptJob:
    """What a script's session is sent: its policy, what else to do, and bench's pace (``extra``)."""
    return ScriptJob(plan=plan.to_dict(), seed=seed, device=device, mode=mode, script=path,
                     task_name=os.path.basename(path), diagnosis=diagnosis, **extra)


def run_script(path: str, args: tuple[str, ...], job: ScriptJob, seed: int, timeout_s: float, workdir: str,
               on_step: Callable[[int, int], None],
               on_message: Callable[[Note], None] | None = None) -> Outcome:
    """One run of the script, its session sent ``job``."""
    run = ScriptRun(path, args, seed, job, name=job.plan.get("name") or "plan", on_message=on_message)
    return ScriptLauncher(workdir).run(run, timeout_s, on_step)


def pace(fp32: PolicyResult, force: bool) -> dict[str, Any]:
    """What a later policy's session needs for bench's in-run protections: fp32's step count and its step
    (``slow_base``: the median, or the fastest step when other processes disturbed it), and the divergence
    patience."""
    extra: dict[str, Any] = {"patience": DIVERGED_PATIENCE}
    base = slow_base(fp32.step_times_s, fp32.warmup, was_disturbed(fp32.disturbance)) if fp32.status == "ok" else None
    if base is not None and not force:
        extra.update(slow_step_s=base[0] / SLOW_RATIO, baseline_step_s=base[0], slow_span_s=base[1],
                     baseline_steps=len(fp32.step_times_s))
    return extra


def _script_plans(path: str, opts: ScriptOptions, dev: Any) -> tuple[dict[str, Plan], Plan | None, bool]:
    """(the plans to run, the baseline first; the baseline named, if any; whether the policies were named), once the
    options are known to suit a script: a one-line error otherwise."""
    refused = list(dict.fromkeys(flag for name, flag in LOOP_OPTIONS.items() if name in opts.model_fields_set
                                 and getattr(opts, name) not in (None, False, "train", ())))
    if refused:
        raise DtypelabError(f"{', '.join(refused)}: not for a training script, which runs its own loop (pass its own "
                            "arguments after --)")
    if not os.path.isfile(path):
        raise DtypelabError(f"no such script: {path}")
    explicit = opts.policies is not None
    plans = {p.name: p for p in tuned(parse_policies(opts.policies) if explicit else
                                      map(get_policy, default_policies("train", dev.type)), opts)}
    named = baseline_policy(opts.baseline) if opts.baseline else None
    for plan in [*plans.values(), *([named] if named else [])]:
        wrong = plan.mode_error("train")
        if wrong and (explicit or plan is named):
            raise DtypelabError(wrong)
        if plan.compiles and (explicit or plan is named):
            raise DtypelabError(f"policy {plan.name}: compiled policies are not supported for scripts yet")
        if plan.loss:  # the script's own code computes its loss: a loss choice would be a name over its loss
            raise DtypelabError(f"policy {plan.name}: +{plan.loss} computes a task's loss, and a script computes its "
                                "own (for a Hugging Face model, bench hf:MODEL takes it)")
    _trainer_refusals(path, [*(plans.values() if explicit else ()), *([named] if named else [])])
    base = named or get_policy(BASELINE)
    return {base.name: base, **{k: v for k, v in plans.items() if not v.compiles and k != base.name}}, named, explicit


def _trainer_refusals(path: str, plans: list[Plan]) -> None:
    """A script that trains with ``dtypelab.hf.Trainer`` or ``SFTTrainer`` (its source read, never run) and a policy
    the Trainer has no TrainingArguments for (a per-module plan): a one-line error before anything runs, not a
    refusal inside that policy's run after the baseline's."""
    names = imported_modules(path)
    if "dtypelab.hf" not in names:
        return
    trainer = "dtypelab.hf.SFTTrainer" if "dtypelab.hf.SFTTrainer" in names else "dtypelab.hf.Trainer"
    for plan in plans:
        if trainer_arguments(plan) is None:
            what = "a per-module plan" if plan.rules else plan.default.label
            raise DtypelabError(f"policy {plan.name}: {os.path.basename(path)} trains with {trainer}, which "
                                f"has no TrainingArguments equivalent of {what}; name the others")


def _first_pass(run: _Runs, plans: dict[str, Plan], report: Report, hardware: Any, named: Plan | None,
                opts: ScriptOptions) -> tuple[dict[str, Plan], Report, bool]:
    """Every policy once, the baseline first: (the plans, the record, whether the sweep goes on to the repeated
    runs). A float64 script's own precision becomes the baseline; a failed baseline stops the sweep. Ctrl-C marks
    the policies not finished interrupted and keeps (and saves) the rest."""
    pending = list(plans)
    try:
        while pending:
            plans, pending, report, go_on = _next_policy(run, plans, pending, report, hardware, named, opts)
            if not go_on:
                return plans, report, False
    except KeyboardInterrupt:
        _interrupted(report, plans, opts.json_path)
        raise
    return plans, report, True


def _interrupted(report: Report, plans: dict[str, Plan], json_path: str | None) -> Report:
    """Ctrl-C: the policies without a result marked interrupted, what finished kept (and saved)."""
    for name in plans:
        if report.result(name) is None:
            report = _with(report, PolicyResult(name, "interrupted", "interrupted before it finished",
                                                info=policy_info(plans[name])), json_path, None)
    return report


def _next_policy(run: _Runs, plans: dict[str, Plan], pending: list[str], report: Report, hardware: Any,
                 named: Plan | None, opts: ScriptOptions) -> tuple[dict[str, Plan], list[str], Report, bool]:
    """The first pending policy run (or skipped): (the plans, what is still pending, the record, whether to go on)."""
    name, pending = pending[0], pending[1:]
    plan = plans[name]
    avail = plan.availability(hardware)
    if not avail.ok or (avail.slow and not opts.force):
        result = PolicyResult(name, "skipped", avail.reason, info=policy_info(plan),
                              skip="slow" if avail.ok else "unsupported")
        run.on_event(Event("skip", name, result=result))
        return plans, pending, _with(report, result, opts.json_path, None), True
    result, primary, built = run.once(plan)
    if named is None and name == report.baseline and plan.default.facts.storage_dtype == "float32" \
            and "float64" in built:
        # the script's own precision is float64: that is what every policy is judged against
        plans, pending, report = _float64_baseline(plans, pending, report, run.on_event)
        run.own_precision = report.baseline
    report = _with(report, result, opts.json_path, primary)
    if name == report.baseline:
        run.extra, run.baseline = pace(result, opts.force), name
        if result.status != "ok" and not opts.keep_going:
            return plans, pending, save_judged(baseline_failed(report, plans, result), opts.json_path), False
    return plans, pending, report, True


def bench_script(target: Target | str, opts: ScriptOptions, on_event: OnEvent | None = None) -> Report:
    """Run a training script once per policy and measure each run: the same record as ``bench`` gives a task, with
    the same protections: the hardware probe's skips (never on a disturbed probe), a run 10x slower per step than
    the baseline stopped after a few steps, a run whose loss stays non-finite stopped. The baseline is fp32, the
    one named (``--baseline``), or fp64 for a script that builds its model in float64 (its own precision). Then the
    baseline and the policies that could be the answer run again, in ABBA order, until their run-level speeds
    separate or ``--runs`` is spent (``repeat_runs``). ``opts`` is a ``BenchOptions``."""
    target = Target.of(target)
    path = target.spec
    dev = resolve_device(opts.device)
    plans, named, explicit = _script_plans(path, opts, dev)
    base = next(iter(plans.values()))
    on_event = on_event or (lambda e: None)
    if opts.hardware is None:
        on_event(Event("probe", "", label="probing hardware"))
    hardware = hardware_for(dev, opts.hardware)
    config = RunConfig(task=path, mode="train", policies=tuple(plans), steps=0, batch_size=0, warmup=0,
                       seed=opts.seed, tolerance=Tolerance.parse(opts.tolerance), device=str(dev), force=opts.force,
                       timeout_s=opts.timeout_s, metric="", higher_is_better=True, task_name=os.path.basename(path),
                       script_args=tuple(opts.script_args), baseline=base.name, runs=getattr(opts, "runs", 1),
                       objective=training_objective(getattr(opts, "objective", None)))
    report = Report(config, environment(hardware), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    for name, plan in plans.items():  # every refusal before the first run, so that an error stays one line
        avail = plan.availability(hardware)
        if not avail.ok and (explicit or plan is named) and name != base.name:
            raise DtypelabError(f"policy {name} cannot run here: {avail.reason}")
    if probe_notice(hardware) and not opts.force:
        on_event(Event("notice", "", label=probe_notice(hardware)))
    run = _Runs(target, opts, dev, on_event)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dtypelab-script-") as run.workdir:
        plans, report, go_on = _first_pass(run, plans, report, hardware, named, opts)  # Ctrl-C: keeps what ran
        if go_on and report.base is not None and report.base.status == "ok":
            budget = parse_duration(opts.budget, "budget")  # the whole sweep's: what the first pass left
            left = None if budget is None else budget - (time.monotonic() - started)
            try:
                report = repeat_runs(report, plans, run, opts.json_path, left)
            except KeyboardInterrupt:
                _interrupted(report, plans, opts.json_path)
                raise
    return save_judged(replace(report, energy_source=_energy_source(report, dev)), getattr(opts, "json_path", None))


def _energy_source(report: Report, dev: torch.device) -> EnergySource:
    """What measured the runs' energy (each run's timed steps, read by its session), or why nothing did."""
    counter, why = counter_of(dev)
    if counter and not any(r.energy for r in report.results):
        why = f"no run's timed steps lasted the {counter} counter's shortest window"
    return EnergySource("" if why else counter, why)


def _float64_baseline(plans: dict[str, Plan], pending: list[str], report: Report, on_event: OnEvent
                      ) -> tuple[dict[str, Plan], list[str], Report]:
    """The baseline (fp32) ran first and found a float64 model: fp64 becomes the baseline and runs next; the first
    is a policy like the others."""
    first, fp64 = report.baseline, plans.get("fp64") or get_policy("fp64")
    plans = {first: plans[first], fp64.name: fp64, **{k: v for k, v in plans.items() if k not in (first, fp64.name)}}
    pending = [fp64.name, *[n for n in pending if n != fp64.name]]
    config = replace(report.config, baseline=fp64.name, policies=tuple(plans))
    on_event(Event("notice", "", label=FLOAT64_NOTE))
    return plans, pending, replace(report, config=config)


class _Runs:
    """One policy's run of the script after another, each in its own process, with what later runs need (the
    baseline's pace)."""

    def __init__(self, target: Target, opts: ScriptOptions, dev: Any, on_event: OnEvent) -> None:
        self.target, self.opts, self.dev, self.on_event = target, opts, dev, on_event
        self.extra: dict[str, Any] = {}
        self.baseline = ""  # whose pace ``extra`` holds: its own repeats are never judged slow against it
        self.workdir = ""
        self.own_precision = ""  # the baseline that is the script's own precision (fp64 for a float64 model)

    def once(self, plan: Plan, label: str = "") -> tuple[PolicyResult, Primary, tuple[str, ...]]:
        """(the run's result, its primary metric, the dtypes the script built its model in)."""
        name, opts = plan.name, self.opts
        self.on_event(Event("start", name, 0, 0, label=label))
        extra = self.extra if name != self.baseline else {k: v for k, v in self.extra.items() if k == "patience"}
        job = job_for(self.target.path, plan, opts.seed, str(self.dev), **extra)
        out = run_script(self.target.path, tuple(opts.script_args), job, opts.seed, opts.timeout_s, self.workdir,
                         lambda d, t: self.on_event(Event("step", name, d, t)))
        result, primary = script_result(out, plan, own_precision=name == self.own_precision)
        result = result if result.info else replace(result, info=policy_info(plan))
        built = tuple(out.messages.get("built_in", ((),))[0])
        # a run that failed after converting the model's floats to another dtype than the script built it in
        if result.status == "failed" and plan.default.facts.storage_dtype not in (built or ("float32",)):
            result = replace(result, reason=result.reason + fixed_dtype_lines(self.target.path))
        self.on_event(Event("done", name, result=result, label=label))
        return result, primary, built


def fixed_dtype_lines(path: str) -> str:
    """Where the script fixes a floating dtype inside a forward (lint's DTL110), as a clause for a failed run's
    reason; "" where it does not."""
    found = [f for f in lint_paths([path], select="DTL110").findings]
    if not found:
        return ""
    lines = ", ".join(str(f.line) for f in found)
    return (f"; the script's own code fixes a floating dtype inside forward at {os.path.basename(path)}:{lines} "
            "(dtypelab lint: DTL110), so a policy that changes the model's dtype meets it there: make them follow "
            "the input (dtype=x.dtype)")


def baseline_failed(report: Report, plans: dict[str, Plan], base: PolicyResult) -> Report:
    """The baseline failed: nothing to compare the others with, so those not run yet are not run (``--keep-going`` runs
    them): each recorded as skipped, saying why."""
    reason = f"not run: the {base.policy} baseline {base.status}, so there is nothing to compare with"
    for name, plan in plans.items():
        if report.result(name) is None:
            report = report.with_result(PolicyResult(name, "skipped", reason, info=policy_info(plan),
                                                     skip="baseline"))
    return report


def _with(report: Report, result: PolicyResult, json_path: str | None, primary: Primary) -> Report:
    """The report with one more result; the metric and its direction come from the first run that gave one."""
    report = report.with_result(result)
    if not report.config.metric and primary and primary[0]:
        metric, higher = primary
        report = replace(report, config=replace(report.config, metric=metric, higher_is_better=higher,
                                                steps=len(result.step_times_s), warmup=result.warmup,
                                                batch_size=result.batch_size))
    return save_judged(report, json_path)


def diagnose_script(target: Target | str, policy: str | Plan, diagnosis: Diagnosis, *, args: tuple[str, ...] = (),
                    device: str | None = None, seed: int = 0, timeout_s: float = 600.0,
                    on_step: Callable[[int, int], None] | None = None,
                    on_message: Callable[[Note], None] | None = None) -> tuple[str | None, Outcome]:
    """Run the script once with ``diagnosis`` on its loop (``trace``, ``audit``): (the record's JSON its session
    sent, or None; the run's outcome, which says why there is none)."""
    target = Target.of(target)
    if not os.path.isfile(target.spec):
        raise DtypelabError(f"no such script: {target.spec}")
    plan = get_policy(policy)
    wrong = plan.mode_error("train")
    if wrong:
        raise DtypelabError(wrong)
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="dtypelab-script-") as workdir:
        job = job_for(target.path, plan, seed, str(dev), mode=type(diagnosis).__name__, diagnosis=diagnosis)
        out = run_script(target.path, tuple(args), job, seed, timeout_s, workdir, on_step or (lambda d, t: None),
                         on_message)
    record = out.messages.get("record")
    return (record[0] if record else None), out


def script_environment(given: dict[str, Any] | None, device: str | None, hardware: Any) -> dict[str, Any]:
    """The environment a script's trace or audit record carries: ``given``, else this machine's (a quick probe,
    or the saved one ``hardware`` names)."""
    return given if given is not None else environment(hardware_for(device, hardware, 0.02))


def script_record(cls: Any, text: str, task: str, env: dict[str, Any]) -> Any:
    """The trace or audit record a script's session wrote, with this process's environment and the script's path."""
    loaded = cls.from_json(text)
    return replace(loaded, environment=env, config=replace(loaded.config, task=task),
                   created=time.strftime("%Y-%m-%dT%H:%M:%S"))
