"""Bench records: one run of several policies on one task. Self-describing: everything a renderer shows
about a policy (what it does, its arithmetic, backend, emulation, why it was skipped) is stored here, so an
old file renders the same whatever today's registry says."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from dtypelab.core.results.decision import Recommendation
from dtypelab.core.results.distributed import DistStats, ScalingEstimate
from dtypelab.core.results.energy import Energy, EnergySource
from dtypelab.core.results.parts import (
    Conversion,
    DisturbanceInfo,
    EmulatedLayer,
    Fidelity,
    LayerFidelity,
    RoundBlock,
    ScalerStats,
    SizeInfo,
    SpeedupInterval,
)
from dtypelab.core.results.profile import ProfileSummary
from dtypelab.core.results.store import Record
from dtypelab.core.results.training_state import MemoryBreakdown, UpdateLoss
from dtypelab.core.stats import Summary, summarize
from dtypelab.core.tolerance import Tolerance

SCHEMA = "dtypelab.report"
# 2: self-describing (policy info, structured skips, typed measurements); 3: the typed tolerance and the
# recommendation in the record; 4: the baseline named in the config; 5: every policy says whether it trains
# float32 weights and keeps its updates (filled from the plan's JSON for records written before); 6: the memory
# breakdown's parts of the activations as labelled data (``parts``), not a field per kind; 7: energy (each policy's
# ``energy`` and ``energy_ci``, the rounds' joules, the record's ``energy_source``) and the config's ``objective``
BENCH_VERSION = 7
PER_LAYER_SAMPLES = 8  # --per-layer compares the first samples of the batch (every layer's output is held)

# Outcome of one policy. "ok" and "diverged" ran to the end; the rest have a reason and maybe no numbers.
STATUSES = ("ok", "diverged", "failed", "timeout", "oom", "skipped", "interrupted")
# Why a policy was skipped: it cannot run on this hardware, it was measured pathologically slow here, or its
# estimated time did not fit in what was left of the sweep's --budget.
SKIP_KINDS = ("", "unsupported", "slow", "budget", "inapplicable")


@dataclass(frozen=True)
class PolicyInfo:
    """What a policy is, as it was when the record was written."""

    name: str
    summary: str = ""
    plan: dict[str, Any] = field(default_factory=dict)  # Plan.to_dict(): default config and per-module rules
    compute_dtype: str = "float32"
    backend: str = "torch"
    arithmetic: str = ""  # what the hardware really computes in, for formats that need saying
    emulated: bool = False  # stored in the format, computed in a wider one: its speed is not the format's
    compiles: bool = False  # the first call compiles (its time is reported apart)
    modes: tuple[str, ...] = ("train", "infer")
    # training: every weight keeps its small updates (float32 weights, a master copy, compensation, stochastic
    # rounding); None in records written before it was kept
    keeps_updates: bool | None = None
    # its weights are float32 (or wider) as the model trains: autocast and tf32, not a pure low-precision cast (every
    # update is rounded into those); None in records written before it was kept
    fp32_weights: bool | None = None
    numerics_only: bool = False  # emulated numerics of a format this hardware cannot run: no speed verdict
    speed_needs: str = ""  # numerics_only: the hardware its speed needs ("a GPU with float8 tensor cores (sm_89+)")


@dataclass(frozen=True)
class RunConfig:
    task: str
    mode: str  # "train" or "infer"
    policies: tuple[str, ...]
    steps: int
    batch_size: int
    warmup: int
    seed: int
    tolerance: Tolerance
    device: str
    force: bool
    timeout_s: float
    metric: str
    higher_is_better: bool
    threads: int | None = None
    per_layer: bool = False
    min_cosine: float = 0.99  # infer: a policy whose worst per-sample cosine vs fp32 is lower is not accepted
    time_box_s: float | None = None  # infer with default steps: timing stopped after this many seconds
    rounds: int = 0  # interleaved timing rounds (0: speed from each policy's own run)
    rounds_block: int = 0  # timed steps per policy per round
    task_name: str = ""  # Task.name (``task`` is how it was given: a built-in name, file.py:fn or pkg.mod:fn)
    profile_steps: int = 0  # --profile: steps profiled per policy after its measurement (0: none)
    script_args: tuple[str, ...] = ()  # a training script's own arguments (``bench train.py -- args``)
    nproc: int = 0  # --nproc: ranks per node under torchrun (0: one process, no torch.distributed)
    nnodes: int = 1
    link_gbps: tuple[float, ...] = ()  # --link-gbps: bandwidths the scaling estimate is given for
    memory_budget_bytes: int | None = None  # --memory-budget: a policy needing more is not chosen
    baseline: str = "fp32"  # the policy every other is judged against (--baseline; fp64 for a float64 script)
    # a script's policies: the most runs per policy, the run-level speed evidence (0: a task, or a record from before
    # scripts' runs were repeated, whose steps decided)
    runs: int = 0
    objective: str = "speed"  # what the fastest policy is chosen for: speed, or energy (the least per sample)

    def __post_init__(self) -> None:
        if not isinstance(self.tolerance, Tolerance):  # "1%" from Python callers: parsed once, here
            object.__setattr__(self, "tolerance", Tolerance.parse(self.tolerance))


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    status: str
    reason: str = ""
    batch_size: int = 0
    warmup: int = 0
    step_times_s: tuple[float, ...] = ()  # raw, warm-up included; train: whole step, infer: forward
    losses: tuple[float, ...] = ()  # every training step
    first_nonfinite_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    fidelity: Fidelity = field(default_factory=dict)  # infer: error vs the fp32 outputs
    peak_memory_bytes: int | None = None  # the run's peak above the memory in use before the model was built
    load_peak_memory_bytes: int | None = None  # the same while building, loading and converting the model
    memory_method: str = ""
    model_bytes: int | None = None
    init_fingerprint: str = ""  # hash of the initial weights: identical across policies
    info: PolicyInfo | None = None
    # skipped: "unsupported" here, measured "slow" here (--force runs it), over "budget", or "inapplicable" to this
    # model or script (no low-bit variant of its optimizer, weights updated by hand)
    skip: str = ""
    scaler: ScalerStats = field(default_factory=dict)  # GradScaler history (amp-fp16)
    size: SizeInfo | None = None  # infer: the converted model's file and linear-weight bytes
    first_call_s: float | None = None  # infer: the first call (compilation, for compiled policies)
    # the interleaved timing's first call: for a compiled policy, compilation again from inductor's on-disk cache,
    # which its own run had filled (what a re-run pays)
    rounds_first_call_s: float | None = None
    # why the interleaved timing left this policy out though it ran: "slower" (its own run already put it clearly
    # below fp32, so no number of rounds could make it the answer)
    rounds_skip: str = ""
    ran_on: str = ""  # a fan-out launcher's job: host, job id and GPU of the learning run (empty: this machine)
    per_layer: tuple[LayerFidelity, ...] = ()  # infer --per-layer
    disturbance: DisturbanceInfo = field(default_factory=dict)  # other processes' CPU use during the timed steps
    rounds: tuple[RoundBlock, ...] = ()  # the interleaved timing's blocks (speed), when it ran
    speedup_ci: SpeedupInterval | None = None  # vs the baseline, from paired rounds
    compiled_ci: SpeedupInterval | None = None  # a compiled policy vs fp32+compile, from paired rounds
    profile: ProfileSummary | None = None  # --profile: where the step's time goes
    distributed: DistStats | None = None  # --nproc: bytes, communication, per-rank memory, the link
    conversion: Conversion = field(default_factory=dict)  # float8 training, int4: the layers converted, left out
    notes: tuple[str, ...] = ()  # what the run found worth a sentence, without its name (said once for all)
    memory: MemoryBreakdown | None = None  # train: where the memory goes, counted from the tensors
    # train, weights in a low-precision float with nothing to keep small updates: the share each parameter's steps
    # lost, over a few steps after the metric was taken (worst first)
    updates: tuple[UpdateLoss, ...] = ()
    emulated_layers: tuple[EmulatedLayer, ...] = ()  # numerics-only (emulated) training: each converted layer
    energy: Energy | None = None  # from the interleaved rounds' windows, where a counter measured them
    # the baseline's joules per step over this policy's, from paired rounds (above 1: it uses less energy)
    energy_ci: SpeedupInterval | None = None
    wall_s: float = 0.0

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "diverged")

    @property
    def timing(self) -> Summary | None:
        return summarize(self.step_times_s[self.warmup:])

    @property
    def throughput(self) -> float | None:
        t = self.timing
        return self.batch_size / t.median if t and t.median > 0 else None

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last 5% of steps (at least one): less noisy than the last step alone."""
        if not self.losses:
            return None
        tail = self.losses[-max(1, len(self.losses) // 20):]
        return sum(tail) / len(tail)

    def metric(self, name: str) -> float | None:
        return self.metrics.get(name)


@functools.cache
def _v1_policies() -> dict[str, Any]:
    """What each policy name meant when version-1 files were first read (frozen: today's registry may differ)."""
    with open(os.path.join(os.path.dirname(__file__), "v1_policies.json")) as f:
        return json.load(f)


def _v1_result(r: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept policy measurements in ``extras`` and no description of the policy: the description is the
    one those names had when v1 files were first read, and "skipped because slow" comes from the reason's
    measured GFLOP/s."""
    r = dict(r)
    extras = r.pop("extras", {}) or {}
    if "grad_scale" in extras:
        r["scaler"] = {k: extras[k] for k in ScalerStats.__annotations__ if k in extras}
    for key in ("size", "first_call_s", "per_layer"):
        if extras.get(key) is not None:
            r[key] = extras[key]
    info = _v1_policies().get(r.get("policy", ""))
    if info is not None:
        r["info"] = info
    if r.get("status") == "skipped":
        r["skip"] = "slow" if "GFLOP/s" in r.get("reason", "") else "unsupported"
    return r


def _migrate_v1(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "results": [_v1_result(r) for r in d.get("results", [])]}


def _migrate_v2(d: dict[str, Any]) -> dict[str, Any]:
    """The tolerance was a string every reader parsed; the recommendation is made when the file is loaded."""
    config = dict(d.get("config") or {})
    if isinstance(config.get("tolerance"), str):
        tol = Tolerance.parse(config["tolerance"])
        config["tolerance"] = {"value": tol.value, "relative": tol.relative}
    return {**d, "config": config}


def _migrate_v3(d: dict[str, Any]) -> dict[str, Any]:
    """Version 3 judged every policy against fp32, and ran a script's policies once each (its steps decided)."""
    return {**d, "config": {"baseline": "fp32", "runs": 0, **(d.get("config") or {})}}


def _v4_info(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Whether a policy of a version-4 record (or older) trains float32 weights, read from its plan's JSON as the
    built-in kinds wrote it then (autocast and tf32 keep float32 weights; a cast keeps its dtype's), and whether it
    keeps its updates (then: exactly when its weights are float32)."""
    if not info or info.get("fp32_weights") is not None:
        return info
    default = (info.get("plan") or {}).get("default") or {}
    fp32 = default.get("kind") in ("autocast", "tf32") or default.get("dtype") in ("float32", "float64")
    kept = info.get("keeps_updates")
    return {**info, "fp32_weights": fp32, "keeps_updates": fp32 if kept is None else kept}


def _migrate_v4(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "results": [{**r, "info": _v4_info(r.get("info"))} if "info" in r else r
                             for r in d.get("results", [])]}


# the one part of the activations records before version 6 had a field for: LoRA's, as its kind labels it now
_V5_PART = ("adapter_inputs", "adapters' inputs", "of the activations, what LoRA's adapters keep for their backward "
            "(their inputs, which the frozen layers beside them would not have kept, and autocast's copies of their "
            "weights)")


def _v5_memory(memory: dict[str, Any] | None) -> dict[str, Any] | None:
    if not memory or _V5_PART[0] not in memory:
        return memory
    memory = dict(memory)
    return {**memory, "parts": [{"label": _V5_PART[1], "bytes": memory.pop(_V5_PART[0]), "note": _V5_PART[2]}]}


def _migrate_v5(d: dict[str, Any]) -> dict[str, Any]:
    """Version 5 held LoRA's adapters' inputs as a field of its own; version 6 holds any kind's parts as a list."""
    return {**d, "results": [{**r, "memory": _v5_memory(r.get("memory"))} if "memory" in r else r
                             for r in d.get("results", [])]}


def _migrate_v6(d: dict[str, Any]) -> dict[str, Any]:
    """Version 6 measured no energy and chose for speed alone."""
    return {**d, "config": {"objective": "speed", **(d.get("config") or {})}}


@dataclass(frozen=True)
class Report(Record):
    config: RunConfig
    environment: dict[str, Any]
    results: tuple[PolicyResult, ...] = ()
    created: str = ""
    scaling: ScalingEstimate | None = None  # --nproc: the estimate from the measured compute and bytes
    # what dtypelab decided from these results, and why (core.judging.judged); None only while a sweep starts
    recommendation: Recommendation | None = None
    rounds_on: str = ""  # a fan-out launcher's job that ran the interleaved timing (empty: this machine)
    energy_source: EnergySource | None = None  # what measured the energy, or why nothing did (None: not asked)
    schema_version: int = BENCH_VERSION

    schema = SCHEMA
    version = BENCH_VERSION
    migrations: ClassVar[dict[int, Any]] = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3, 4: _migrate_v4,
                                            5: _migrate_v5, 6: _migrate_v6}

    def with_result(self, result: PolicyResult) -> Report:
        """A new report with ``result`` added (or replaced), kept in the config's policy order."""
        kept = [r for r in self.results if r.policy != result.policy] + [result]
        order = {name: i for i, name in enumerate(self.config.policies)}
        kept.sort(key=lambda r: order.get(r.policy, len(order)))
        return replace(self, results=tuple(kept))

    def result(self, policy: str) -> PolicyResult | None:
        return next((r for r in self.results if r.policy == policy), None)

    def ran(self, policy: str) -> PolicyResult:
        """The result of a policy the judging knows ran (a KeyError otherwise: a bug, not a user's mistake)."""
        found = self.result(policy)
        if found is None:
            raise KeyError(policy)
        return found

    @property
    def baseline(self) -> str:
        """The policy every other is judged against: fp32 unless the run named another."""
        return self.config.baseline

    @property
    def base(self) -> PolicyResult | None:
        return self.result(self.config.baseline)
