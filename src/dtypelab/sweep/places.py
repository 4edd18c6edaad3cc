"""Where a sweep's runs go and what a re-run keeps: the launcher the options name (the fan-out ones built from their
settings), the device a Slurm node will use, the hardware probe as a piece of work for such a node, and the finished
runs of an interrupted sweep that a re-run with the same ``--json`` keeps."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo, hardware_for
from dtypelab.core.policies import BASELINE
from dtypelab.core.records import load_report, save_judged
from dtypelab.core.results import PolicyResult, Report, RunConfig
from dtypelab.run import (
    LAUNCHERS,
    Event,
    FanOutLauncher,
    Launcher,
    Outcome,
    parse_gpus,
    parse_minutes,
    parse_slurm_args,
)
from dtypelab.sweep.options import BenchOptions
from dtypelab.sweep.plans import policy_result

FAN_OUT = ("local-gpus", "slurm")


def launcher_for(opts: BenchOptions, task_object: bool = False) -> Launcher:
    """The launcher the options name; a Task object (``task_object``) runs inline: its closures live in this
    process and cannot travel to a child, so a launcher that would need them to is refused in one line."""
    given = opts.launcher
    if task_object:
        inline = given is None or given == "inline" or given is LAUNCHERS["inline"]
        if not inline or opts.nproc is not None:
            raise DtypelabError(f"a Task object runs in this process only (launcher 'inline'): for "
                                f"{'torchrun' if opts.nproc is not None else f'launcher {given!r}'} give its spec, "
                                "'file.py:make_task' or 'pkg.module:make_task'")
        return LAUNCHERS["inline"]
    if given is None:
        return LAUNCHERS["process"]
    if isinstance(given, str):
        if given in FAN_OUT:
            return _fan_out(given, opts)
        if given not in LAUNCHERS:
            raise DtypelabError(f"launcher: unknown launcher {given!r}: use {', '.join([*LAUNCHERS, *FAN_OUT])} "
                                "(--launcher)")
        return LAUNCHERS[given]
    return given


def _fan_out(kind: str, opts: BenchOptions) -> FanOutLauncher:
    folder = os.path.abspath(opts.jobs_folder)
    if kind == "slurm":
        return FanOutLauncher("slurm", folder, gpus_per_job=opts.gpus_per_job, partition=opts.partition,
                              time_min=parse_minutes(opts.slurm_time), slurm_args=parse_slurm_args(opts.slurm_args))
    count = torch.cuda.device_count()
    gpus = parse_gpus(opts.gpus) or tuple(range(count))
    if not gpus:
        raise DtypelabError("--launcher local-gpus: this machine has no CUDA GPU (the default launcher runs one "
                            "policy after another)")
    missing = [g for g in gpus if g >= count]
    if missing:
        raise DtypelabError(f"--gpus: no GPU {missing[0]}: this machine has {count}")
    return FanOutLauncher("local-gpus", folder, gpus=gpus)


@dataclass(frozen=True)
class ProbeWork:
    """The hardware probe as a piece of work: on Slurm it runs on a node of the cluster, not on the login node."""

    device: str

    @property
    def name(self) -> str:
        return "hardware probe"

    def __call__(self, report: Any) -> HardwareInfo:
        return hardware_for(self.device)


def slots(launcher: FanOutLauncher) -> str:
    if launcher.kind == "slurm":
        return "a job array" + (f" on partition {launcher.partition}" if launcher.partition else "")
    if launcher.gpus:
        return f"{len(launcher.gpus)} at once, on GPU {', '.join(map(str, launcher.gpus))}"
    return f"{launcher.slots} CPU process(es) at once"


def remote_device(device: str | None) -> torch.device:
    """A Slurm node's device, which this (login) machine cannot check: CUDA unless told otherwise."""
    try:
        dev = torch.device(device or "cuda")
    except RuntimeError as exc:
        raise DtypelabError(f"invalid device {device!r}: use cpu, cuda or cuda:N") from exc
    if dev.type not in ("cpu", "cuda"):
        raise DtypelabError(f"unsupported device {device!r}: dtypelab measures on cpu or cuda")
    return dev


def finished_before(opts: BenchOptions, config: RunConfig, env: dict[str, Any]) -> dict[str, PolicyResult]:
    """The finished learning runs of an interrupted sweep with the same settings, on the same hardware and
    versions, in ``--json``'s file: a re-run keeps them. A complete record is measured again (that is what
    re-running a finished sweep asks for); fp32 always is, as the others' yardstick and their shared files'
    writer."""
    path = opts.json_path
    if opts.fresh or not path or not os.path.exists(path):
        return {}
    try:
        old = load_report(path)
    except Exception:  # not a bench record, or damaged: it will be overwritten, as before
        return {}
    same = ("task", "mode", "steps", "batch_size", "warmup", "seed", "tolerance", "device", "threads",
            "per_layer", "min_cosine", "script_args", "nproc")
    hw = ("device_name", "cpu_name", "cpu_capability")
    if any(getattr(old.config, f, None) != getattr(config, f, None) for f in same) or \
            any(old.environment.get(k) != env.get(k) for k in ("dtypelab", "torch")) or \
            any((old.environment.get("hardware") or {}).get(k) != (env.get("hardware") or {}).get(k) for k in hw):
        return {}
    finished = {r.policy: r for r in old.results if r.status in ("ok", "diverged", "oom")}
    unfinished = [p for p in config.policies if p not in finished and
                  ((old.result(p) is None) or old.result(p).status in ("interrupted", "timeout", "failed"))]
    if not unfinished:
        return {}
    return {name: replace(r, rounds=(), speedup_ci=None, compiled_ci=None, rounds_first_call_s=None,
                          rounds_skip="") for name, r in finished.items()
            if name != BASELINE and name in config.policies}


def fanned(report: Report, jobs: list[Any], pending: list[str], steps: int, launcher: FanOutLauncher,
           opts: BenchOptions, on_event: Any) -> Report:
    """After fp32 (whose weights, outputs and step the others need), every other learning run at once through the
    fan-out launcher; each result saved as it comes. ``pending`` loses each name as it finishes, so that Ctrl-C marks
    only the unfinished ones."""
    on_event(Event("notice", "", label=f"{len(jobs)} runs fanned out ({launcher.kind}, {slots(launcher)}); "
                                       "the time budget does not apply to runs that go side by side"))
    for name in pending:
        on_event(Event("start", name, 0, steps, label=f"{name}: pending"))

    def on_state(name: str, state: str, done: int, total: int) -> None:
        if state in ("pending", "running"):
            on_event(Event("state", name, done, total, label=state))

    def on_outcome(job: Any, out: Outcome) -> None:
        nonlocal report
        result = policy_result(out, job.plan)
        report = save_judged(report.with_result(result), opts.json_path)
        pending.remove(job.name)
        on_event(Event("done", job.name, result=result))

    launcher.run_many(jobs, opts.timeout_s, on_state, on_outcome)
    return report
