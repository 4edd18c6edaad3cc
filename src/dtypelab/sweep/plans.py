"""What a sweep runs: its defaults (steps, rounds, the distributed policies), the plans with their baselines, a plan's
patterns checked against the model before any child starts, and a launcher's outcome as a policy's result."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies import BASELINE, COMPILED_BASELINE, Plan, get_policy, policy_info
from dtypelab.core.policies.registry import emulated_version, gpu_only_policies
from dtypelab.core.results import PolicyResult
from dtypelab.core.task import Task
from dtypelab.run import Outcome

INFER_STEPS = 50
# With the default step count, inference timing stops after this many seconds of timed passes (and at least
# MIN_TIMED passes after warm-up): on a CPU where one pass of a real model takes 2 s, 50 passes per policy
# would be most of a sweep's time and add nothing to a median. --steps N always times exactly N.
INFER_TIME_BOX_S = 8.0
# When interleaved rounds follow, they decide speed and a run's own latency is a column and the slow check only:
# this much of timed passes (about 2 s saved per policy on minilm, 11 policies on an AVX-512 CPU).
INFER_TIME_BOX_ROUNDS_S = 2.0
MIN_TIMED = 4
DEFAULT_ROUNDS = {"train": 5, "infer": 3}
MORE_ROUNDS = 3  # a policy the rounds have not decided yet (rounds._undecided) gets up to this many times the rounds
# --nproc without --policies: plain DDP (the baseline), each gradient compression, FSDP2 with and without bf16
DISTRIBUTED_DEFAULTS = ("fp32", "fp32+ddp-fp16", "fp32+ddp-bf16", "fp32+ddp-powersgd", "fp32+fsdp",
                        "fp32+fsdp-bf16-params-fp32-reduce")



def emulate_here(plans: dict[str, Plan], explicit: bool, mode: str, device: torch.device) -> dict[str, Plan]:
    """--emulate: each plan this device cannot run (float8 training needs CUDA compute capability 8.9+, MX 10.0+) that
    has an emulated counterpart runs as that instead; a default sweep also gets the emulated version of every
    GPU-only policy it left out that this device cannot run."""
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    here = HardwareInfo(device=str(device), device_name="", cpu_name="", cpu_flags=(), cpu_capability="",
                        cuda_capability=capability, threads=1, gflops={})

    def swap(plan: Plan) -> Plan:
        emulated = emulated_version(plan) if plan.gpu_only and not plan.availability(here).ok else None
        return emulated if emulated is not None else plan

    out = {p.name: p for p in map(swap, plans.values())}
    if not explicit:
        for name in gpu_only_policies(mode):
            emulated = swap(get_policy(name))
            if emulated.numerics_only:
                out.setdefault(emulated.name, emulated)
    return out


def check_patterns(task: Task, plans: Iterable[Plan]) -> None:
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


def with_baselines(plans: dict[str, Plan], explicit: bool, baseline: str = BASELINE) -> dict[str, Plan]:
    """Table order: the registry's for a default sweep, else the user's with fp32 (the reference run, whose weights
    and outputs the others start from) added first; a named ``baseline`` (--baseline) next when it is not there;
    compiled fp32 beside any compiled policy, whose speed means little against eager fp32 alone."""
    if BASELINE not in plans or explicit:
        plans = {BASELINE: get_policy(BASELINE), **plans}
    if baseline not in plans:
        plans = {BASELINE: plans[BASELINE], baseline: get_policy(baseline),
                 **{k: v for k, v in plans.items() if k != BASELINE}}
    if any(p.compiles for p in plans.values()) and COMPILED_BASELINE not in plans:
        plans = {BASELINE: plans[BASELINE], COMPILED_BASELINE: get_policy(COMPILED_BASELINE),
                 **{k: v for k, v in plans.items() if k != BASELINE}}
    return plans


def policy_result(out: Outcome, plan: Plan) -> PolicyResult:
    """A launcher's outcome as the policy's result: the job's own result, or why there is none."""
    if out.ok and out.value is not None:
        result = out.value
        if out.reason:  # e.g. a torchrun rank that died in teardown: the measurement stands, the fact is kept
            result = replace(result, reason="; ".join(filter(None, (result.reason, out.reason))))
    elif out.ok:  # every rank of this node finished, none of them global rank 0
        result = PolicyResult(plan.name, "skipped", "this node ran worker ranks; the result is on the node with "
                              "global rank 0", skip="unsupported")
    else:
        result = PolicyResult(plan.name, out.status, out.reason)
    return replace(result, info=result.info or policy_info(plan), wall_s=result.wall_s or out.wall_s,
                   ran_on=out.where or result.ran_on)
