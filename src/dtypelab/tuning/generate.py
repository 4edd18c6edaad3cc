"""``tune --mode generate``: a per-layer serving plan (which linear layers stay bfloat16, or int8, under int4) that
keeps the KL divergence from the bfloat16 model within a budget and gives the most forecast decode tokens a second
(or the least weight memory) on a GPU the user names.

- **Units** are what vLLM fuses and so must share a scheme (its compressed-tensors loader refuses a fused layer
  whose parts differ): a decoder layer's q/k/v projections, its gate/up projections, and every other linear layer
  alone. The output head stays bfloat16 (llm-compressor's recipes ignore it).
- **Each unit's cost** in each candidate: measured here, the KL divergence of the model with that unit alone
  converted (GPTQ and AWQ calibrated as bench calibrates them); forecast for the GPU, the seconds its weights take
  to read per decode step at batch 1 (stored bytes over the card's bandwidth times the kernel's share, the
  forecast's memory-bound decode: ``serving.kernels``), and its stored bytes.
- **The search** (exact for the additive model): the Pareto frontier of (KL, seconds, bytes) built unit by unit,
  dominated partial plans dropped; the plan chosen is the frontier's best within the budget. Its KL is then
  measured with every chosen unit converted at once; where it exceeds the budget (KL is not exactly additive) the
  next plan down the frontier is measured, up to ``VERIFY`` times. Checked against brute force
  (tests/test_tune_generate.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dtypelab.core.calibration import calibrating
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import device_spec
from dtypelab.core.policies import Cast, Plan, WeightQuant, get_policy
from dtypelab.core.results import FrontierPoint, GeneratePlanReport, PlanChoice, PlanUnit
from dtypelab.forecasting import STORED_WEIGHT_BYTES as stored_bytes
from dtypelab.serving import (
    QUALITY_SEQUENCES,
    VLLM_FUSED,
    built,
    calibration_windows,
    kernel_of,
    kl_divergence,
    load_served,
)

BF16 = Cast("bfloat16")
VERIFY = 4  # plans down the frontier measured when the chosen one's measured KL exceeds the budget
EVAL_LEN = 256


@dataclass(frozen=True)
class Unit:
    """Layers converted together, with each choice's (KL alone, forecast seconds a token, stored bytes)."""

    name: str
    layers: tuple[str, ...]
    costs: dict[str, tuple[float, float, int]]


def units(model: nn.Module, kept: set[str] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The model's linear layers as vLLM fuses them, in module order, less those the formats leave as they are
    (``kept``; by default the output head, as compressed-tensors' formats leave it)."""
    kept = WeightQuant().leaves(model) if kept is None else kept
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in kept]
    out: list[tuple[str, tuple[str, ...]]] = []
    done: set[str] = set()
    for n in names:
        if n in done:
            continue
        parent, leaf = n.rsplit(".", 1) if "." in n else ("", n)
        group = next((g for g in VLLM_FUSED if leaf in g), (leaf,))
        layers = tuple(f"{parent}.{g}" if parent else g for g in group if f"{parent}.{g}" in names or g == leaf)
        done.update(layers)
        out.append((f"{parent}.{'+'.join(g.rsplit('.', 1)[-1] for g in layers)}" if parent else n, layers))
    return out


# --- the search ------------------------------------------------------------------------------------------------------

Partial = tuple[float, float, int, tuple[str, ...]]  # (KL, seconds, bytes, each unit's choice so far)


def _key(p: Partial, objective: str) -> tuple[float, float]:
    return (p[1], p[2]) if objective == "speed" else (p[2], p[1])


def frontier(table: Sequence[Unit], objective: str = "speed") -> list[Partial]:
    """Every plan not beaten on both KL and the objective by another (exact over the additive costs), least KL
    first."""
    front: list[Partial] = [(0.0, 0.0, 0, ())]
    for unit in table:
        grown = [(kl + c[0], s + c[1], b + c[2], (*picks, choice))
                 for kl, s, b, picks in front for choice, c in unit.costs.items()]
        grown.sort(key=lambda p: (p[0], _key(p, objective)))
        front, best = [], None
        for p in grown:
            if best is None or _key(p, objective) < best:
                front.append(p)
                best = _key(p, objective)
    return front


def best_within(front: Sequence[Partial], budget: float, objective: str = "speed") -> Partial | None:
    within = [p for p in front if p[0] <= budget * (1 + 1e-12)]
    return min(within, key=lambda p: (_key(p, objective), p[0]), default=None)


def brute_force(table: Sequence[Unit], budget: float, objective: str = "speed") -> Partial | None:
    """Every combination of choices (the check the search is held to)."""
    best: Partial | None = None
    for picks in itertools.product(*(list(u.costs) for u in table)):
        costs = [u.costs[c] for u, c in zip(table, picks, strict=True)]
        p = (sum(c[0] for c in costs), sum(c[1] for c in costs), sum(c[2] for c in costs), tuple(picks))
        if p[0] <= budget * (1 + 1e-12) and (best is None or (_key(p, objective), p[0]) < (_key(best, objective),
                                                                                           best[0])):
            best = p
    return best


# --- measuring -------------------------------------------------------------------------------------------------------

@dataclass
class _Judge:
    """The served model and held-out windows: the KL of any plan from the bfloat16 model's next-token distribution."""

    spec: str
    seed: int
    calibration: torch.Tensor | None
    windows: torch.Tensor
    base: torch.Tensor | None = None

    def logprobs(self, plan: Plan) -> torch.Tensor:
        with calibrating(self.calibration):
            model, _, _ = built(load_served(self.spec), plan, self.seed, torch.device("cpu"))
        with torch.no_grad():
            return F.log_softmax(model(self.windows).logits.float(), -1)

    def kl(self, plan: Plan) -> float:
        if self.base is None:
            self.base = self.logprobs(Plan(BF16, name="bf16"))
        return float(kl_divergence(self.base, self.logprobs(plan)).mean())


def plan_of(table: Sequence[Unit], picks: Sequence[str], name: str = "") -> Plan:
    """bfloat16 everywhere, each unit's layers in its choice."""
    rules = tuple((layer, get_policy(c).default) for u, c in zip(table, picks, strict=True) if c != "bf16"
                  for layer in u.layers)
    return Plan(BF16, rules, name=name or "generate-plan")


@dataclass(frozen=True)
class Target:
    bandwidth: float  # bytes a second
    capability: tuple[int, int]
    label: str


def _unit_costs(model: nn.Module, layers: tuple[str, ...], cands: list[Plan], target: Target,
                judge: _Judge) -> dict[str, tuple[float, float, int]]:
    modules = dict(model.named_modules())
    bf16 = sum(modules[n].weight.numel() * 2 for n in layers)
    costs = {"bf16": (0.0, bf16 / target.bandwidth, bf16)}
    for plan in cands:
        config = plan.default
        stored, seconds = 0, 0.0
        for n in layers:
            b = stored_bytes(config, modules[n]) or modules[n].weight.numel() * 2
            key = getattr(config, "kernel", lambda m: None)(modules[n])
            share = kernel_of(key, "vllm", target.capability).share if key else 1.0
            stored, seconds = stored + b, seconds + b / (target.bandwidth * share)
        rules = tuple((n, config) for n in layers)
        costs[plan.name] = (judge.kl(Plan(BF16, rules, name=plan.name)), seconds, stored)
    return costs


def tune_generate(spec: str, candidates: str, gpu: str, budget: float, objective: str, seed: int,
                  progress: Callable[[str], None], calibration: str | None = None,
                  samples: int = 32) -> GeneratePlanReport:
    """The per-layer plan for ``spec`` served on ``gpu`` (see the module)."""
    start = time.perf_counter()
    cands = [get_policy(c.strip()) for c in candidates.split(",") if c.strip()]
    bad = [p.name for p in cands if p.rules or type(p.default).__name__ != "WeightQuant"]
    if bad:
        raise DtypelabError(f"tune --mode generate: {', '.join(bad)} is not a weight-only format it can place per "
                            "layer (w4a16-rtn, w4a16-gptq, w4a16-awq, w8a16-*)")
    spec_gpu = device_spec(gpu)
    if not spec_gpu.bandwidth_gbs:
        raise DtypelabError(f"--gpu {gpu}: no memory bandwidth on record for {spec_gpu.label}")
    target = Target(spec_gpu.bandwidth_gbs * 1e9, spec_gpu.capability, spec_gpu.label)
    served = load_served(spec)
    length = min(EVAL_LEN, served.context)
    cal, cal_words = calibration_windows(served, calibration, samples, length)
    judge = _Judge(spec, seed, cal, served.text(QUALITY_SEQUENCES, length))
    model = served.make_model()
    groups = units(model, set().union(*(p.default.leaves(model) for p in cands)))
    table = []
    for i, (name, layers) in enumerate(groups):
        progress(f"measuring unit {i + 1}/{len(groups)}: {name}")
        table.append(Unit(name, layers, _unit_costs(model, layers, cands, target, judge)))
    front = frontier(table, objective)
    verified = _verified(table, front, budget, objective, judge)
    return _report(spec, served.name, table, front, verified, target, budget, objective, cal_words,
                   time.perf_counter() - start)


def _verified(table: list[Unit], front: list[Partial], budget: float, objective: str, judge: _Judge) -> Verified:
    """The best frontier plan within the budget whose KL, measured with all its units converted, stays within it."""
    tried: list[tuple[str, float]] = []
    pool = sorted((p for p in front if p[0] <= budget * (1 + 1e-12)), key=lambda p: (_key(p, objective), p[0]))
    for p in pool[:VERIFY]:
        kl = judge.kl(plan_of(table, p[3]))
        tried.append(("+".join(sorted(set(p[3]))), kl))
        if kl <= budget:
            return p, kl, tuple(tried)
    return None, None, tuple(tried)


Verified = tuple[Partial | None, float | None, tuple[tuple[str, float], ...]]  # (chosen, its KL whole, all tried)


def _report(spec: str, name: str, table: list[Unit], front: list[Partial], verified: Verified, target: Target,
            budget: float, objective: str, calibration: str, seconds: float) -> GeneratePlanReport:
    chosen, measured, tried = verified
    base_s = sum(u.costs["bf16"][1] for u in table)
    base_b = sum(u.costs["bf16"][2] for u in table)
    rows = tuple(PlanUnit(u.name, u.layers, tuple(PlanChoice(c, *v) for c, v in u.costs.items()),
                          chosen[3][i] if chosen else "bf16") for i, u in enumerate(table))
    points = tuple(FrontierPoint(p[0], base_s / p[1] if p[1] else 1.0, p[2] / base_b, p is chosen) for p in front)
    plan = plan_of(table, chosen[3], f"{name}-served") if chosen else Plan(BF16, name="bf16")
    return GeneratePlanReport(spec, name, target.label, objective, budget, rows, points, plan.to_dict(),
                              measured, tried, calibration, seconds, time.strftime("%Y-%m-%dT%H:%M:%S"))


__all__ = ["Unit", "best_within", "brute_force", "frontier", "plan_of", "tune_generate", "units"]
