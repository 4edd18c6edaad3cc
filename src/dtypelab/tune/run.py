"""``tune()``: the fastest per-layer plan that keeps the model's outputs within ``min_cosine`` of fp32's, for
inference, measured on this machine. Training plans are not tuned yet (issue #15 continues)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.hardware import environment, probe
from dtypelab.core.loop import build_model, to_device
from dtypelab.core.policies import Plan, get_policy, parse_policies
from dtypelab.core.results import LayerChoice, PlanEvaluation, TuneConfig, TuneReport
from dtypelab.core.task import Task, load_task
from dtypelab.tune.infer import InferenceBench, evaluator, layer_plan, targets
from dtypelab.tune.search import budget_for, search

Progress = Callable[[str], None]


def tune(task: str | Task, *, mode: str = "infer", candidates: str = "int8-dyn", min_cosine: float = 0.999,
         batch_size: int | None = None, device: str | None = None, weights: str | None = None, seed: int = 0,
         output: str | None = None, json_path: str | None = None, progress: Progress | None = None) -> TuneReport:
    """Choose, per layer, which candidate config (or fp32) each layer runs in so that inference is as fast as
    measured possible while the worst per-sample output cosine vs fp32 stays at or above ``min_cosine``.

    Sensitivity per layer: the model with that layer alone converted, its worst output cosine. Gain per layer: the
    layer's own forward on the inputs it gets, fp32 against the candidate (medians). Then ``tune.search`` with at
    most L + 2·log2(L) full evaluations, each an end-to-end timing and fidelity check of a real plan. ``output``
    writes the chosen plan as a plan file (``--policies plan.json``, ``export --policy plan.json``,
    ``dtypelab.apply_plan``)."""
    if mode != "infer":
        raise DtypelabError("dtypelab tune chooses inference plans so far: use --mode infer (training plans: "
                            "write them by hand, see README 'Policies are configs; plans choose per module')")
    if not 0 < min_cosine <= 1:
        raise DtypelabError(f"--min-cosine must be in (0, 1], got {min_cosine:g}")
    progress = progress or (lambda text: None)
    start = time.perf_counter()
    task_obj = load_task(task) if isinstance(task, str) else task
    cands = parse_policies(candidates)
    for plan in cands:
        if plan.rules or plan.compiles:
            raise DtypelabError(f"candidate {plan.name}: a candidate is one whole-model config, not a plan")
    hw = probe(device, budget_s=0.02)
    dev = torch.device(hw.device)
    for plan in cands:
        avail = plan.availability(hw)
        if not avail.ok:
            raise DtypelabError(f"candidate {plan.name} cannot run here: {avail.reason}")
    bs = batch_size or task_obj.batch_size
    inputs = to_device(task_obj.inference_inputs(bs), dev)
    bench = InferenceBench(lambda: build_model(task_obj, seed, weights), inputs, dev)
    names = sorted({n for c in cands for n in targets(bench.base_model, c)},
                   key=list(dict(bench.base_model.named_modules())).index)
    if not names:
        raise DtypelabError(f"no layer of {task_obj.name}'s model can take {candidates} (Linear / Conv layers)")
    progress(f"scoring {len(names)} layers × {len(cands)} candidates")
    scored = bench.score(names, cands, on_layer=lambda n: progress(f"scored {n}"))
    choice = {s.name: get_policy(s.config) for s, _ in scored}
    budget = budget_for(len(scored))
    progress(f"searching: at most {budget} full evaluations")
    result = search([s for s, _ in scored], evaluator(bench, choice, min_cosine), budget)
    uniform = []
    for cand in cands:  # each candidate everywhere it applies, measured the same way, for comparison
        plan = layer_plan({n: cand for n in targets(bench.base_model, cand)})
        sp, cos = bench.evaluate(plan)
        uniform.append(PlanEvaluation(tuple(n for n, _ in plan.rules), sp, cos, cos >= min_cosine,
                                      f"{cand.name} on every layer it applies to"))
    best = result.best
    chosen = best.layers if best is not None else frozenset()
    plan = layer_plan({n: choice[n] for n in names if n in chosen}, name=f"{task_obj.name}-tuned")
    layers = []
    for s, tried in scored:
        alone = f"alone {s.gain * 1e6:+.1f} µs per call, cosine cost {s.sensitivity:.2e}"
        if s.name in chosen:
            why = f"converted ({alone}); the plan was measured end to end"
        elif best is None:
            why = f"kept fp32 ({alone}): no plan measured was both faster than fp32 and within the cosine"
        else:
            why = f"kept fp32 ({alone}): the plans that converted it were slower or broke the cosine"
        layers.append(LayerChoice(s.name, s.config, s.sensitivity, s.gain, s.name in chosen, why, tuple(tried)))
    report = TuneReport(
        config=TuneConfig(task=task if isinstance(task, str) else task_obj.name, mode=mode,
                          candidates=tuple(c.name for c in cands), min_cosine=min_cosine, batch_size=bs,
                          device=str(dev), budget=budget, task_name=task_obj.name),
        environment=environment(hw), plan=plan.to_dict(), speedup=best.speedup if best else 1.0,
        fidelity=best.fidelity if best else 1.0, layers=tuple(layers),
        evaluations=tuple(PlanEvaluation(tuple(sorted(e.layers)), e.speedup, e.fidelity, e.feasible, e.why)
                          for e in result.evaluations),
        uniform=tuple(uniform), base_s=bench.base_s, wall_s=time.perf_counter() - start,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if output:
        with open(output, "w") as f:
            f.write(plan.to_json() + "\n")
    if json_path:
        report.save(json_path)
    return report


def apply_plan(model: torch.nn.Module, plan: str | Plan | dict[str, Any], device: str | None = None
               ) -> torch.nn.Module:
    """Your own model under a plan (a plan file, a policy name, a Plan): converted, each module in its config,
    with ``forward`` running under the plan's precision (inputs converted, autocast when the plan asks). A plan
    that names modules the model lacks is an error naming them."""
    from dtypelab.core.policies import Precision, plan_from_dict

    plan = plan_from_dict(plan) if isinstance(plan, dict) else get_policy(plan)
    dev = torch.device(device) if device else next((p.device for p in model.parameters()), torch.device("cpu"))
    precision = Precision(plan, dev)
    model = precision.convert_module(model.to(dev))
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = precision.convert_input(args), precision.convert_input(kwargs)
        with precision.forward_context():
            return original(*args, **kwargs)

    model.forward = forward
    return model
