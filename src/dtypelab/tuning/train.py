"""Measuring side of the per-layer search for training. A candidate (a whole-model cast or autocast config) runs
everywhere except on "fp32 islands": layers kept in float32 with their parameters, inputs cast up and, under
autocast, autocast disabled (``Precision``'s regions). The search chooses which layers leave their island.

- Sensitivity per layer: a short training probe with that layer alone converted, its loss curve against fp32's
  on the same batches from the same initial weights (mean relative deviation over the probe's second half),
  plus a penalty from the range audit's verdict for the candidate's format on that layer (overflow, underflow).
- Gain per layer: the layer's own forward and backward on the inputs it really gets, fp32 against converted.
- Full evaluation: train the whole plan for the task's steps, evaluate the task's metric (the constraint: within
  tolerance of fp32's, not diverged), and time training steps interleaved with the fp32 model's.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtypelab.core.loop import build_trainable, evaluate, fit, to_device, train_step
from dtypelab.core.policies import Cast, Plan, Precision, single
from dtypelab.core.results import AuditReport
from dtypelab.core.task import Task, call_model
from dtypelab.core.tolerance import Tolerance, judge
from dtypelab.tuning.adapters import RANGE_DTYPE
from dtypelab.tuning.infer import evaluation
from dtypelab.tuning.search import Evaluation, LayerScore
from dtypelab.tuning.timing import REPS, Paired, paired

SEVERITY_PENALTY = (0.0, 0.01, 0.1, 1.0)  # audit severity 0 safe .. 3 overflow, added to the probe's deviation
FP32 = Cast("float32")


def train_targets(model: nn.Module) -> list[str]:
    """The layers that can be an fp32 island: leaf modules that own parameters (Linear, Conv, Embedding, norms)."""
    return [name for name, m in model.named_modules()
            if name and not list(m.children()) and any(True for _ in m.parameters(recurse=False))]


def island_plan(candidate: Plan, converted: frozenset[str] | set[str], layers: list[str], name: str = "") -> Plan:
    """``candidate`` everywhere, every layer of ``layers`` not ``converted`` kept in float32."""
    rules = tuple((n, FP32) for n in layers if n not in converted)
    return Plan(candidate.default, rules, name=name or (candidate.name if not rules else ""))


@dataclass
class Trained:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    losses: list[float]
    metric: float
    diverged: bool


@dataclass
class TrainBench:
    """The task trained in fp32 once; plans trained the same way and compared with it."""

    task: Task
    device: torch.device
    steps: int
    batch_size: int
    tolerance: Tolerance
    seed: int = 0
    probe_steps: int = 0  # 0: a quarter of the steps, at least 10
    reps: int = REPS
    audits: dict[str, AuditReport] = field(default_factory=dict)  # candidate format -> fp32 range audit

    def __post_init__(self) -> None:
        self.probe_steps = self.probe_steps or min(self.steps, max(10, self.steps // 4))
        self.base = self.train(single(FP32, "fp32"), self.steps)
        self.batch = to_device(self.task.batch(self.steps, self.batch_size), self.device)
        step = self._step(self.base)
        self.base_s = paired(step, step, self.device, self.reps, grad=True).base_s

    @property
    def metric(self) -> str:
        return self.task.metric

    def train(self, plan: Plan, steps: int, metric: bool = True) -> Trained:
        precision = Precision(plan, self.device)
        model, optimizer = build_trainable(self.task, precision, self.device, self.seed)
        run = fit(self.task, model, precision, optimizer, self.device, steps, self.batch_size, self.seed)
        value = math.nan
        if metric and not run.diverged:
            with precision.session():
                value = evaluate(self.task, model, precision, self.device).get(self.task.metric, math.nan)
        diverged = run.diverged or (metric and not math.isfinite(value))
        return Trained(model, optimizer, precision, run.losses, value, diverged)

    def _step(self, t: Trained) -> Callable[[], Any]:
        inputs, target = self.batch
        return lambda: train_step(self.task, t.model, t.precision, t.optimizer, inputs, target)

    def feasible(self, metric: float, diverged: bool) -> bool:
        return not diverged and judge(metric, self.base.metric, self.tolerance, self.task.higher_is_better)[0]

    def evaluate(self, plan: Plan) -> tuple[Paired | None, float, bool]:
        """(its training steps timed against fp32's — None when it diverged —, the metric after training, whether
        it keeps the constraint)."""
        t = self.train(plan, self.steps)
        if t.diverged:
            return None, t.metric, False
        with t.precision.session():
            timing = paired(self._step(self.base), self._step(t), self.device, self.reps, grad=True)
        return timing, t.metric, self.feasible(t.metric, False)

    def probe(self, plan: Plan) -> float:
        """Relative deviation of the plan's loss curve from fp32's over the second half of a short probe."""
        losses = self.train(plan, self.probe_steps, metric=False).losses
        ref = self.base.losses[:self.probe_steps]
        half = len(ref) // 2
        if len(losses) < len(ref) or not all(math.isfinite(v) for v in losses):
            return math.inf
        scale = statistics.fmean(abs(v) for v in ref[half:]) or 1.0
        return statistics.fmean(abs(a - b) for a, b in zip(losses[half:], ref[half:], strict=True)) / scale

    def layer_inputs(self, names: list[str]) -> dict[str, tuple[Any, Any]]:
        """The (args, kwargs) each named layer gets in a forward of a copy of the trained fp32 model."""
        model = copy.deepcopy(self.base.model)
        modules, seen = dict(model.named_modules()), {}
        handles = [modules[n].register_forward_pre_hook(
            lambda m, args, kwargs, n=n: seen.setdefault(n, (args, kwargs)), with_kwargs=True) for n in names]
        try:
            with torch.no_grad():
                call_model(model, self.batch[0])
        finally:
            for h in handles:
                h.remove()
        return seen

    def layer_gain(self, name: str, candidate: Plan, args: Any, kwargs: Any) -> float:
        """Seconds per forward + backward the layer saves converted alone (negative: it gets slower)."""
        layer = copy.deepcopy(dict(self.base.model.named_modules())[name])
        wrapper = nn.Sequential()  # a plan names modules by path: give the layer a parent
        wrapper.add_module("layer", copy.deepcopy(layer))
        precision = Precision(Plan(FP32, (("layer", candidate.default),)), self.device)
        converted = precision.convert_module(wrapper).layer

        def step(module: nn.Module) -> Callable[[], None]:
            def run() -> None:
                module.zero_grad(set_to_none=True)
                out = module(*args, **kwargs)
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    first.float().sum().backward()
            return run

        with precision.session():
            timing = paired(step(layer), step(converted), self.device, self.reps, grad=True)
        return timing.base_s - timing.other_s

    def penalties(self, candidate: Plan, names: list[str]) -> dict[str, tuple[float, str]]:
        """Per layer (penalty, the audit's verdict) for the candidate's format; nothing for float32 formats."""
        fmt = _format(candidate)
        report = self.audits.get(fmt) if fmt else None
        out: dict[str, tuple[float, str]] = {}
        for entry in report.layers if report is not None else ():
            owner = next((n for n in names if entry.name == n or entry.name.startswith(n + ".")), None)
            verdict = entry.verdicts.get(fmt, "")
            if owner is None or entry.severity == 0 or (owner in out and out[owner][0] >= entry.severity):
                continue
            out[owner] = (SEVERITY_PENALTY[min(entry.severity, 3)], f"{entry.kind}: {verdict}")
        return out

    def score(self, names: list[str], candidate: Plan, on_layer: Callable[[str], None] | None = None
              ) -> list[tuple[LayerScore, str]]:
        """Each layer's (sensitivity, gain) for ``candidate`` and the audit verdict that added to it, if any."""
        inputs = self.layer_inputs(names)
        penalties = self.penalties(candidate, names)
        out = []
        for name in names:
            deviation = self.probe(Plan(FP32, ((name, candidate.default),)))
            penalty, verdict = penalties.get(name, (0.0, ""))
            args, kwargs = inputs.get(name, ((), {}))
            gain = self.layer_gain(name, candidate, args, kwargs) if args else 0.0
            sens = deviation + penalty if math.isfinite(deviation) else 1e9
            out.append((LayerScore(name, sens, gain, candidate.name), verdict))
            if on_layer is not None:
                on_layer(name)
        return out


def _format(candidate: Plan) -> str | None:
    return RANGE_DTYPE(candidate.default)


def train_evaluator(bench: TrainBench, candidate: Plan, layers: list[str]
                    ) -> Callable[[frozenset[str]], Evaluation]:
    sign = 1.0 if bench.task.higher_is_better else -1.0  # the search's fidelity is higher-is-better

    def run(chosen: frozenset[str]) -> Evaluation:
        timing, metric, ok = bench.evaluate(island_plan(candidate, chosen, layers))
        fidelity = sign * metric if math.isfinite(metric) else -math.inf
        return evaluation(chosen, timing, fidelity, ok) if timing else Evaluation(chosen, 0.0, fidelity, False)

    return run
