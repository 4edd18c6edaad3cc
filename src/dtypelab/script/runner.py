"""``dtypelab bench train.py [-- args]``: the user's own script, run once per policy, each in its own process.

The script is run as it is (``python -m dtypelab.script.boot train.py args``: ``python train.py args`` with the RNGs
seeded before its first line), with ``DTYPELAB_JOB`` naming a JSON file that tells its
``dtypelab.session()`` (or the Lightning / Hugging Face integration) which policy to use; the session writes
``<job>.started``, ``<job>.progress`` and, at ``finish()``, ``<job>.result`` next to it. A crash, a hang or a
script that never calls ``finish`` becomes a result that says so; the other policies still run.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dtypelab.core.disturbance import was_disturbed
from dtypelab.core.errors import DtypelabError
from dtypelab.core.hardware import SLOW_RATIO, HardwareInfo, environment, hardware_for, probe_notice, resolve_device
from dtypelab.core.judging import Tolerance
from dtypelab.core.loop import DIVERGED_PATIENCE
from dtypelab.core.policies import BASELINE, Config, Plan, default_policies, get_policy, parse_policies, policy_info
from dtypelab.core.records import save_judged
from dtypelab.core.results import PolicyResult, Report, RunConfig
from dtypelab.script.boot import ENV_SEED
from dtypelab.script.session import ENV_JOB, warmup_steps
from dtypelab.sweep.launch import Event, OnEvent, death_reason, last_line, stop_process

POLL_S = 0.1


@dataclass(frozen=True)
class ScriptJob:
    path: str
    args: tuple[str, ...]
    plan: Plan
    seed: int
    device: str
    workdir: str
    mode: str = "bench"  # or "trace" / "audit": the session arms the guard or the range audit
    extra: tuple[tuple[str, Any], ...] = ()  # the audit's steps, every, layers, formats; bench: fp32's pace

    @property
    def policy(self) -> str:
        return self.plan.name

    @property
    def job_file(self) -> str:
        return os.path.join(self.workdir, re.sub(r"[^A-Za-z0-9_.+-]", "_", self.policy) + ".job.json")


def _missing_call(job: ScriptJob) -> str:
    started = os.path.exists(job.job_file + ".started")
    if not started:
        return ("the script never created a dtypelab session: add `lab = dtypelab.session()` near its top (or use "
                "dtypelab.lightning.Trainer / dtypelab.hf.Trainer)")
    return ("the script ended without calling lab.finish(...): add `lab.finish(accuracy=...)` (your metric) after "
            "its evaluation")


Primary = tuple[str, bool] | None  # the run's primary metric and whether higher is better


def run_script(job: ScriptJob, timeout_s: float, on_step: Callable[[int, int], None]) -> tuple[PolicyResult, Primary]:
    """One policy: the script in a fresh process under ``timeout_s``; its session's result (and primary metric),
    or why there is none."""
    with open(job.job_file, "w") as f:
        json.dump({"plan": job.plan.to_dict(), "seed": job.seed, "device": job.device, "mode": job.mode,
                   "script": job.path, "task_name": os.path.basename(job.path), **dict(job.extra)}, f)
    log = job.job_file.replace(".job.json", ".log")
    env = {**os.environ, ENV_JOB: job.job_file, ENV_SEED: str(job.seed), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dtypelab.script.boot", job.path, *job.args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(), start_new_session=True)
    try:
        while proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                stop_process(proc)
                return PolicyResult(job.policy, "timeout", f"stopped after the {timeout_s:g} s time limit",
                                    wall_s=time.monotonic() - start), None
            time.sleep(POLL_S)
            try:
                with open(job.job_file + ".progress") as f:
                    on_step(json.load(f)["steps"], 0)
            except (OSError, ValueError, KeyError):
                pass
    finally:
        stop_process(proc)  # Ctrl-C in the parent: never leave the script running
    wall = time.monotonic() - start
    if proc.returncode != 0:
        status, reason = death_reason(proc.returncode, log)
        if proc.returncode > 0:
            tail = last_line(log)
            reason = f"the script exited with code {proc.returncode}" + (f": {tail}" if tail else "")
        return PolicyResult(job.policy, status, reason, wall_s=wall), None
    if os.path.exists(job.job_file + ".skip"):
        with open(job.job_file + ".skip") as f:
            skip = json.load(f)
        times = tuple(skip.get("step_times_s") or ())
        return PolicyResult(job.policy, "skipped", skip["reason"], skip=skip.get("kind", "unsupported"), wall_s=wall,
                            step_times_s=times, warmup=warmup_steps(len(times)) if times else 0,
                            losses=tuple(float(x) for x in skip.get("losses") or ()),
                            disturbance=skip.get("disturbance") or {}), None
    try:
        with open(job.job_file + ".result") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return PolicyResult(job.policy, "failed", _missing_call(job), wall_s=wall), None
    return _result(job, data, wall), (data.get("metric") or "", bool(data.get("higher_is_better", True)))


def _result(job: ScriptJob, d: dict, wall: float) -> PolicyResult:
    if not d.get("setup_called"):
        return PolicyResult(job.policy, "failed", "the script never called lab.setup(model, optimizer): the policy "
                                                  "was not applied to its model", wall_s=wall)
    times = tuple(d["step_times_s"])
    losses = tuple(float(x) for x in d["losses"])
    first_bad = d.get("first_nonfinite_step")
    diverged = first_bad is not None and losses and not math.isfinite(losses[-1])
    reason = f"loss non-finite from step {first_bad}" if diverged else ""
    if diverged and d.get("stopped"):
        reason += f"; {d['stopped']}"
    return PolicyResult(
        policy=job.policy, status="diverged" if diverged else "ok", batch_size=int(d.get("batch_size") or 0),
        reason=reason, warmup=warmup_steps(len(times)),
        step_times_s=times, losses=losses, first_nonfinite_step=first_bad, metrics=d["metrics"],
        peak_memory_bytes=d["peak_memory_bytes"], load_peak_memory_bytes=d.get("load_peak_memory_bytes"),
        memory_method=d["memory_method"], model_bytes=d.get("model_bytes"),
        init_fingerprint=d.get("init_fingerprint", ""), scaler=d.get("scaler") or {}, info=policy_info(job.plan),
        wall_s=wall, disturbance=d.get("disturbance") or {})


def pace(fp32: PolicyResult, force: bool) -> tuple[tuple[str, Any], ...]:
    """What a later policy's session needs for bench's in-run protections: fp32's step count and median step
    (when fp32 was timed undisturbed: a disturbed median would make every policy look slow), and the
    divergence patience."""
    extra: list[tuple[str, Any]] = [("patience", DIVERGED_PATIENCE)]
    timing = fp32.timing
    if fp32.status == "ok" and timing and not force and not was_disturbed(fp32.disturbance):
        extra += [("slow_step_s", timing.median / SLOW_RATIO), ("baseline_step_s", timing.median),
                  ("baseline_steps", len(fp32.step_times_s))]
    return tuple(extra)


def bench_script(path: str, policies: str | Sequence[str | Config | Plan] | None = None, *,
                 args: Sequence[str] = (), tolerance: str = "1%", device: str | None = None, seed: int = 0,
                 force: bool = False, timeout_s: float = 600.0, json_path: str | None = None,
                 on_event: OnEvent | None = None, hardware: HardwareInfo | str | None = None) -> Report:
    """Run a training script once per policy and measure each run: the same record as ``bench`` gives a task,
    with the same protections: the hardware probe's skips (never on a disturbed probe), a run 10x slower per step
    than fp32 stopped after a few steps, a run whose loss stays non-finite stopped."""

    if not os.path.isfile(path):
        raise DtypelabError(f"no such script: {path}")
    if timeout_s <= 0:
        raise DtypelabError(f"--timeout must be positive, got {timeout_s:g}")
    tol = Tolerance.parse(tolerance)
    explicit = policies is not None
    plans = {p.name: p for p in (parse_policies(policies) if explicit else map(get_policy, default_policies("train")))}
    for plan in plans.values():
        wrong = plan.mode_error("train")
        if wrong and explicit:
            raise DtypelabError(wrong)
        if plan.compiles and explicit:
            raise DtypelabError(f"policy {plan.name}: compiled policies are not supported for scripts yet")
    plans = {BASELINE: get_policy(BASELINE), **{k: v for k, v in plans.items() if not v.compiles}}
    dev = resolve_device(device)
    on_event = on_event or (lambda e: None)
    if hardware is None:
        on_event(Event("probe", "", label="probing hardware"))
    hardware = hardware_for(dev, hardware)
    config = RunConfig(task=path, mode="train", policies=tuple(plans), steps=0, batch_size=0, warmup=0, seed=seed,
                       tolerance=str(tol), device=str(dev), force=force, timeout_s=timeout_s, metric="",
                       higher_is_better=True, task_name=os.path.basename(path), script_args=tuple(args))
    report = Report(config, environment(hardware), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    for name, plan in plans.items():  # every refusal before the first run, so that an error stays one line
        avail = plan.availability(hardware)
        if not avail.ok and explicit and name != BASELINE:
            raise DtypelabError(f"policy {name} cannot run here: {avail.reason}")
    if probe_notice(hardware) and not force:
        on_event(Event("notice", "", label=probe_notice(hardware)))
    extra: tuple[tuple[str, Any], ...] = ()
    with tempfile.TemporaryDirectory(prefix="dtypelab-script-") as workdir:
        try:
            for name, plan in plans.items():
                avail = plan.availability(hardware)
                if not avail.ok or (avail.slow and not force):
                    result = PolicyResult(name, "skipped", avail.reason, info=policy_info(plan),
                                          skip="slow" if avail.ok else "unsupported")
                    report = _with(report, result, json_path, None)
                    on_event(Event("skip", name, result=result))
                    continue
                on_event(Event("start", name, 0, 0))
                job = ScriptJob(os.path.abspath(path), tuple(args), plan, seed, str(dev), workdir, extra=extra)
                result, primary = run_script(job, timeout_s, lambda d, t, n=name: on_event(Event("step", n, d, t)))
                result = result if result.info else replace(result, info=policy_info(plan))
                if name == BASELINE:
                    extra = pace(result, force)
                report = _with(report, result, json_path, primary)
                on_event(Event("done", name, result=result))
        except KeyboardInterrupt:
            for name in plans:
                if report.result(name) is None:
                    report = _with(report, PolicyResult(name, "interrupted", "interrupted before it finished",
                                                        info=policy_info(plans[name])), json_path, None)
            raise
    return report


def _with(report: Report, result: PolicyResult, json_path: str | None, primary: Primary) -> Report:
    """The report with one more result; the metric and its direction come from the first run that gave one."""
    report = report.with_result(result)
    if not report.config.metric and primary and primary[0]:
        metric, higher = primary
        report = replace(report, config=replace(report.config, metric=metric, higher_is_better=higher,
                                                steps=len(result.step_times_s), warmup=result.warmup,
                                                batch_size=result.batch_size))
    report = save_judged(report, json_path)
    return report


def diagnose_script(mode: str, path: str, policy: str | Plan, *, args: Sequence[str] = (), device: str | None = None,
                    seed: int = 0, timeout_s: float = 600.0, on_step: Callable[[int, int], None] | None = None,
                    **extra: Any) -> tuple[str | None, PolicyResult]:
    """Run the script once in ``mode`` ("trace" or "audit"): (the record's JSON its session wrote, or None; the
    run's result, which says why there is no record)."""
    if not os.path.isfile(path):
        raise DtypelabError(f"no such script: {path}")
    plan = get_policy(policy)
    wrong = plan.mode_error("train")
    if wrong:
        raise DtypelabError(wrong)
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="dtypelab-script-") as workdir:
        job = ScriptJob(os.path.abspath(path), tuple(args), plan, seed, str(dev), workdir, mode, tuple(extra.items()))
        result, _ = run_script(job, timeout_s, on_step or (lambda d, t: None))
        try:
            with open(job.job_file + ".record") as f:
                return f.read(), result
        except OSError:
            return None, result


def script_record(cls: Any, text: str, task: str, environment: dict[str, Any]) -> Any:
    """The trace or audit record a script's session wrote, with this process's environment and the script's path."""
    loaded = cls.from_json(text)
    return replace(loaded, environment=environment, config=replace(loaded.config, task=task),
                   created=time.strftime("%Y-%m-%dT%H:%M:%S"))
