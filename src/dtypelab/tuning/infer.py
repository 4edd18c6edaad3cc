"""Measuring side of the per-layer search for inference: each layer's sensitivity (the model's worst output
cosine vs fp32 with that layer alone converted) and gain (the layer's own forward, timed on the inputs it really
gets, fp32 against the candidate), then full evaluations of plans (end-to-end latency and worst cosine).

All timing is in this process, on this hardware, as medians of repeated calls; the model is the task's (trained
fp32 weights when given, else its factory's)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.loop import forward, to_device
from dtypelab.core.policies import Cast, Plan, Precision, get_policy
from dtypelab.core.task import call_model, map_tensors
from dtypelab.inference import compare, flat
from dtypelab.tuning.adapters import LAYER_TYPES
from dtypelab.tuning.search import Evaluation, LayerScore
from dtypelab.tuning.timing import REPS, Paired, paired

FP32 = Cast("float32")


def targets(model: nn.Module, candidate: Plan) -> list[str]:
    """The layers a candidate can convert: Linear layers for quantization, any leaf with weights for a cast."""
    kinds = LAYER_TYPES(candidate.default)
    return [name for name, m in model.named_modules() if name and not list(m.children()) and isinstance(m, kinds)]


def layer_plan(layers: dict[str, Plan], name: str = "") -> Plan:
    """fp32 everywhere, each chosen layer in its candidate's config (a rule restating fp32 is no conversion and is
    left out)."""
    rules = tuple((n, plan.default) for n, plan in layers.items() if plan.default != FP32)
    return Plan(FP32, rules, name=name if rules else "fp32")


@dataclass
class InferenceBench:
    """One model and its inputs: times and compares plans against the fp32 model."""

    make_model: Callable[[], nn.Module]
    inputs: Any
    device: torch.device
    reps: int = REPS

    def __post_init__(self) -> None:
        self.base_model = self.make_model().to(self.device).eval()
        self.reference = self._outputs(self.base_model, Precision(get_policy("fp32"), self.device))
        run = self._base_call
        self.base_s = paired(run, run, self.device, self.reps).base_s

    def _base_call(self) -> Any:
        return call_model(self.base_model, self.inputs)

    def _outputs(self, model: nn.Module, precision: Precision) -> Any:
        with torch.no_grad(), precision.session():
            out = forward(model, precision, self.inputs)
        return map_tensors(lambda t: t.detach().float().cpu() if t.is_floating_point() else t.cpu(), out)

    def converted(self, plan: Plan) -> tuple[nn.Module, Precision]:
        precision = Precision(plan, self.device)
        model = copy.deepcopy(self.base_model)
        with calibrating(task_feed(self.inputs)):  # GPTQ and AWQ read the inputs the plan is judged on
            return precision.convert_module(model).eval(), precision

    def evaluate(self, plan: Plan) -> tuple[Paired, float]:
        """(its timing against fp32's end to end, output cosine vs fp32: see ``output_cosine``)."""
        model, precision = self.converted(plan)
        with precision.session():
            timing = paired(self._base_call, lambda: forward(model, precision, self.inputs), self.device, self.reps)
        return timing, output_cosine(self.reference, self._outputs(model, precision))

    def cosine(self, plan: Plan) -> float:
        """Output cosine vs fp32 alone: a layer's sensitivity needs one forward pass, not ``evaluate``'s 26 timed
        ones (on minilm, a second instead of half a minute per layer)."""
        model, precision = self.converted(plan)
        return output_cosine(self.reference, self._outputs(model, precision))

    def layer_inputs(self, names: list[str]) -> dict[str, tuple[Any, Any]]:
        """The (args, kwargs) each named layer is called with in the fp32 model's forward on the inputs."""
        seen: dict[str, tuple[Any, Any]] = {}
        modules = dict(self.base_model.named_modules())
        handles = [modules[n].register_forward_pre_hook(
            lambda m, args, kwargs, n=n: seen.setdefault(n, (args, kwargs)), with_kwargs=True) for n in names]
        try:
            with torch.no_grad():
                call_model(self.base_model, self.inputs)
        finally:
            for h in handles:
                h.remove()
        return seen

    def layer_gain(self, name: str, candidate: Plan, args: Any, kwargs: Any) -> float:
        """Seconds per call the layer saves converted alone (negative: it gets slower)."""
        layer = dict(self.base_model.named_modules())[name]
        wrapper = nn.Sequential()  # quantization configs convert Linear children: give the layer a parent
        wrapper.add_module("layer", copy.deepcopy(layer))
        precision = Precision(Plan(Cast("float32"), (("layer", candidate.default),)), self.device)
        converted = precision.convert_module(wrapper).layer
        with precision.session():
            timing = paired(lambda: layer(*args, **kwargs),
                            lambda: converted(*to_device(args, self.device), **kwargs), self.device, self.reps)
        return timing.base_s - timing.other_s

    def score(self, names: list[str], candidates: list[Plan], on_layer: Callable[[str], None] | None = None,
              max_sensitivity: float = 1.0) -> list[tuple[LayerScore, list[tuple[str, float, float]]]]:
        """Each layer's best candidate (see ``pick``) and every candidate's (name, sensitivity, gain) for the
        record."""
        inputs = self.layer_inputs(names)
        out = []
        for name in names:
            tried = []
            for cand in candidates:
                if name not in targets(self.base_model, cand):
                    continue
                cos = self.cosine(layer_plan({name: cand}))
                args, kwargs = inputs.get(name, ((), {}))
                tried.append((cand.name, 1.0 - cos, self.layer_gain(name, cand, args, kwargs) if args else 0.0))
            if on_layer is not None:
                on_layer(name)
            if not tried:
                continue
            best = pick(tried, max_sensitivity)
            out.append((LayerScore(name, max(best[1], 0.0), best[2], best[0]), tried))
        return out


def output_cosine(reference: Any, outputs: Any) -> float:
    """The inference constraint's measure: the worst per-sample output cosine vs fp32. Where each sample has one
    output value (a regression, a binary logit) a per-sample cosine is always ±1, so the cosine of the whole
    batch's outputs stands in; 0 when the outputs' shapes differ."""
    fid = compare(reference, outputs)
    if "cos_min" in fid or not fid:
        return float(fid.get("cos_min", 0.0))
    return float(torch.nn.functional.cosine_similarity(flat(reference), flat(outputs), dim=0, eps=1e-30))


def pick(tried: list[tuple[str, float, float]], max_sensitivity: float) -> tuple[str, float, float]:
    """A layer's candidate from its (name, sensitivity, gain) per candidate: the most gain among those that alone
    keep the constraint (sensitivity ≤ ``max_sensitivity``), else the least harm per unit of gain. Harm per gain
    first would let a faithful but slower kernel win a layer that a faster one converts just as acceptably."""
    ok = [t for t in tried if t[1] <= max_sensitivity and t[2] > 0]
    if ok:
        return max(ok, key=lambda t: (t[2], -t[1]))
    return max(tried, key=lambda t: (t[2] > 0, -t[1] / t[2] if t[2] > 0 else -1e9, t[2]))


def alternatives(scored: list[tuple[LayerScore, list[tuple[str, float, float]]]]) -> dict[str, list[LayerScore]]:
    """Per layer, its other candidates that gain alone, named ``layer@candidate`` for the search."""
    return {s.name: [LayerScore(f"{s.name}@{c}", max(sens, 0.0), gain, c) for c, sens, gain in tried
                     if c != s.config and gain > 0] for s, tried in scored}


def chosen_configs(chosen: frozenset[str], choice: dict[str, Plan]) -> dict[str, Plan]:
    """The search's keys (``layer`` for its first choice, ``layer@candidate`` for an alternative) as layer → plan."""
    out = {}
    for key in sorted(chosen):
        name, _, alt = key.partition("@")
        out[name] = get_policy(alt) if alt else choice[name]
    return out


def evaluation(chosen: frozenset[str], timing: Paired, fidelity: float, feasible: bool, why: str = ""
               ) -> Evaluation:
    """A full evaluation from its paired timing against fp32."""
    ci = timing.interval
    return Evaluation(chosen, ci.point if ci else timing.speedup, fidelity, feasible, why,
                      low=ci.low if ci else math.nan, high=ci.high if ci else math.nan, disturbed=timing.disturbed)


def evaluator(bench: InferenceBench, choice: dict[str, Plan], min_cosine: float
              ) -> Callable[[frozenset[str]], Evaluation]:
    def evaluate(chosen: frozenset[str]) -> Evaluation:
        timing, cos = bench.evaluate(layer_plan(chosen_configs(chosen, choice)))
        return evaluation(chosen, timing, cos, cos >= min_cosine)

    return evaluate
