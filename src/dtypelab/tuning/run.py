"""``tune()``: the fastest per-layer plan that keeps the constraint, measured on this machine. Inference: each
layer fp32 or a candidate (int8, bf16, ...), worst output cosine vs fp32 at least ``min_cosine``. Training: a
candidate (bf16, amp-bf16, ...) everywhere but on fp32 islands, the task's metric within ``tolerance`` of fp32's
after the same training."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.loop import build_model, to_device
from dtypelab.core.machine.hardware import HardwareInfo, environment, hardware_for, probe_notice
from dtypelab.core.options import parse_duration
from dtypelab.core.policies import (
    Cast,
    Plan,
    Precision,
    get_policy,
    parse_policies,
    plan_from_dict,
)
from dtypelab.core.results import (
    LayerChoice,
    TuneConfig,
    TuneReport,
    check_writable,
    save_text,
)
from dtypelab.core.task import Task
from dtypelab.core.tolerance import Tolerance
from dtypelab.core.wrapping import LabModule
from dtypelab.numerics import audit
from dtypelab.run import Target
from dtypelab.tuning.adapters import RANGE_DTYPE, TUNES
from dtypelab.tuning.explain import (
    NOTHING_CHOSEN,
    disturbance_note,
    evaluation_record,
    finish,
    layer_why,
    none_found,
    nothing_to_search,
)
from dtypelab.tuning.infer import (
    FP32,
    InferenceBench,
    alternatives,
    chosen_configs,
    evaluation,
    evaluator,
    layer_plan,
    targets,
)
from dtypelab.tuning.options import DEFAULT_CANDIDATES, TuneOptions
from dtypelab.tuning.search import Evaluation, LayerScore, Limit, budget_for, pareto, search
from dtypelab.tuning.train import TrainBench, island_plan, train_evaluator, train_targets

Progress = Callable[[str], None]



def _told(evaluate: Callable[[frozenset[str]], Evaluation], budget: int | None, progress: Callable[[str], None],
          prefix: str) -> Callable[[frozenset[str]], Evaluation]:
    """``evaluate``, saying each full evaluation (the search's long part) before it starts and what it found."""
    count = [0]
    most = f" of at most {budget}" if budget else ""

    def told(layers: frozenset[str]) -> Evaluation:
        count[0] += 1
        plural = "" if len(layers) == 1 else "s"
        progress(f"{prefix}full evaluation {count[0]}{most}: {len(layers)} layer{plural} converted")
        e = evaluate(layers)
        progress(f"{prefix}full evaluation {count[0]}: {e.speedup:.2f}x fp32, "
                 f"{'keeps' if e.feasible else 'breaks'} the constraint")
        return e

    return told

def _candidate_error(plan: Plan, mode: str) -> str | None:
    """Why ``plan`` cannot be a candidate of a ``mode`` search, or None."""
    # float8 training compiles by its nature (torchao needs it); any other compiled candidate is a plan choice
    if plan.rules or (plan.compiles and not plan.default.facts.always_compiles):
        return f"candidate {plan.name}: a candidate is one whole-model config, not a plan"
    if plan.numerics_only:  # tune chooses for speed; an emulation has none of its format's
        return (f"candidate {plan.name}: emulated numerics only, no speed to tune for; bench it (bench --emulate) to "
                "see whether the model keeps its metric in that format")
    if plan.program:  # one program for the whole model: no layer can be chosen into it
        return (f"candidate {plan.name}: a whole-model {plan.program} program, not a config for layers; bench it "
                "(bench --mode infer, or --mode generate for a language model) beside the others")
    if plan.state is not None:
        return (f"candidate {plan.name}: a candidate is a config for layers; the optimizer's state "
                f"(+{plan.state.label}) is the whole optimizer's (bench it as a policy)")
    if mode == "train" and ("train" not in TUNES(plan.default) or plan.default == FP32):
        return (f"candidate {plan.name}: training plans take a whole-model cast, autocast or float8 training (bf16, "
                "fp16, amp-bf16, amp-fp16, bf16-sr, bf16-kahan, fp8-tensorwise), kept in fp32 on chosen layers")
    return None


def _candidates(candidates: Any, mode: str) -> tuple[list[Plan], list[str]]:
    """The candidates to search (a one-line error for one that cannot be), and the notes on those left out."""
    cands = parse_policies(candidates or DEFAULT_CANDIDATES[mode])
    for plan in cands:
        wrong = _candidate_error(plan, mode)
        if wrong:
            raise DtypelabError(wrong)
    notes: list[str] = []
    same = [p.name for p in cands if p.default == FP32]
    if same:  # fp32 is every plan's default: "converting" a layer to it changes nothing
        notes.append(f"{', '.join(same)}: left out of the candidates, fp32 is the plan's default (no conversion)")
        cands = [p for p in cands if p.default != FP32]
        if not cands:
            raise DtypelabError("no candidate to convert to: fp32 is the default every plan starts from; give "
                                "e.g. --candidates int8-dyn (infer) or bf16 (train)")
    return cands, notes


def tune(task: str | Task, options: TuneOptions | None = None, *, progress: Progress | None = None,
         **settings: Any) -> TuneReport:
    """Choose, per layer, the precision each layer runs in so that the model is as fast as measured possible while
    it keeps the constraint; every plan reported was measured end to end (see the README's "dtypelab tune").

    ``mode="infer"``: each layer fp32 or one of ``candidates``; sensitivity = the model's worst output cosine with
    that layer alone converted, gain = the layer's own forward timed fp32 against converted; the constraint is a
    worst per-sample output cosine vs fp32 of at least ``min_cosine``. ``mode="train"``: per candidate (a whole
    model cast or autocast), which layers stay fp32 islands; sensitivity = a short training probe's loss deviation
    from fp32 with the layer alone converted, plus the range audit's verdict; gain = the layer's forward and
    backward; the constraint is the task's metric after ``steps`` steps within ``tolerance`` of fp32's. Either
    way, at most L + 2·log2(L) full evaluations per candidate, and a plan is chosen only when its paired timing's
    whole 95% interval lies above the no-gain band (as ``bench`` decides). ``output`` writes the chosen plan as a plan
    file. A candidate that is fp32 itself is no conversion and is left out; one the hardware probe measured
    pathologically slow here is left out unless ``force`` (every candidate slow: a record that keeps fp32).
    ``options`` is a ``TuneOptions`` (or its fields as keywords)."""
    opts = TuneOptions.build(options, **settings)
    output, json_path = opts.output, opts.json_path
    check_writable(output, json_path)  # before a search that may take many minutes
    if opts.mode == "generate":
        return _saved(_tune_generate(task, opts, progress or (lambda text: None)), output, json_path)
    mode, candidates, min_cosine, force = opts.mode, opts.candidates, opts.min_cosine, opts.force
    steps, batch_size, seed = opts.steps, opts.batch_size, opts.seed
    tol = Tolerance.parse(opts.tolerance)
    progress = progress or (lambda text: None)
    start = time.perf_counter()
    limit = Limit(parse_duration(opts.budget, "budget"))  # the whole command's time, loading the task included
    target = Target.of(task)
    task_obj = target.task()
    if mode == "train" and task_obj.inference_only:
        raise DtypelabError(f"task {task_obj.name} is inference-only: nothing to train (use --mode infer)")
    cands, notes = _candidates(candidates, mode)
    hw = hardware_for(opts.device, opts.hardware, budget_s=0.02)
    for plan in cands:
        avail = plan.availability(hw)
        if not avail.ok:
            raise DtypelabError(f"candidate {plan.name} cannot run here: {avail.reason}")
    if hw.disturbed:
        notes.append(probe_notice(hw, "candidate", "the search measures each one on the model itself"))
    slow = {p.name: p.availability(hw).reason for p in cands if p.availability(hw).slow and not force}
    if slow:
        notes += [f"{name}: left out, {why}; --force searches with it anyway" for name, why in slow.items()]
        cands = [p for p in cands if p.name not in slow]
    spec = target.spec
    if not cands:
        report = nothing_to_search(spec, task_obj, mode, slow, hw, min_cosine, tol, steps, batch_size)
    elif mode == "train":
        report = _tune_train(spec, task_obj, cands, hw, tol, opts, progress, limit)
    else:
        report = _tune_infer(spec, task_obj, cands, hw, min_cosine, batch_size, opts.weights, seed, progress, limit)
    report = finish(replace(report, notes=tuple(notes) + report.notes), time.perf_counter() - start, bool(cands))
    return _saved(report, output, json_path)


def _saved(report: Any, output: str | None, json_path: str | None) -> Any:
    """The record, its chosen plan written as a plan file and the record saved, as asked."""
    if output:
        save_text(output, Plan.from_dict(report.plan).to_json() + "\n")
    if json_path:
        report.save(json_path)
    return report


def _tune_generate(task: str | Task, opts: TuneOptions, progress: Progress) -> Any:
    """tune --mode generate (``tuning.generate``): its record."""
    from dtypelab.tuning.generate import tune_generate

    if not isinstance(task, str):
        raise DtypelabError("tune --mode generate serves a model by name (tinylm, hf:MODEL, a task file)")
    return tune_generate(task, opts.candidates or DEFAULT_CANDIDATES["generate"], opts.gpu or "h100", opts.kl_budget,
                         opts.goal, opts.seed, progress, opts.calibration, opts.calibration_samples)


def _infer_layers(scored: list[tuple[LayerScore, Any]], configs: dict[str, Plan], found: bool) -> list[LayerChoice]:
    """Each scored layer's choice as the record says it: what it was scored in, or the alternative the refinement
    converted it with."""
    layers = []
    for s, tried in scored:
        taken = configs.get(s.name)
        if taken is not None and taken.name != s.config:  # converted by an alternative the refinement tried
            s = next(LayerScore(s.name, max(sens, 0.0), gain, c) for c, sens, gain in tried if c == taken.name)
        layers.append(LayerChoice(s.name, s.config, s.sensitivity, s.gain, taken is not None,
                                  layer_why(s, taken is not None, found, "per call, cosine cost"), tuple(tried)))
    return layers


def _tune_infer(spec: str, task_obj: Task, cands: list[Plan], hw: HardwareInfo, min_cosine: float,
                batch_size: int | None, weights: str | None, seed: int, progress: Progress,
                limit: Limit) -> TuneReport:
    dev = torch.device(hw.device)
    bs = batch_size or task_obj.batch_size
    inputs = to_device(task_obj.inference_inputs(bs), dev)
    bench = InferenceBench(lambda: build_model(task_obj, seed, weights), inputs, dev)
    names = sorted({n for c in cands for n in targets(bench.base_model, c)},
                   key=list(dict(bench.base_model.named_modules())).index)
    if not names:
        raise DtypelabError(f"no layer of {task_obj.name}'s model can take {', '.join(c.name for c in cands)} "
                            "(Linear / Conv layers)")
    progress(f"scoring {len(names)} layers × {len(cands)} candidates")
    scored = bench.score(names, cands, on_layer=lambda n: progress(f"scored {n}"), max_sensitivity=1 - min_cosine)
    choice = {s.name: get_policy(s.config) for s, _ in scored}
    budget = budget_for(len(scored))
    progress(f"searching: at most {budget} full evaluations")
    # each candidate everywhere it applies is measured too, for comparison; the search's first plan is that
    # already where one candidate takes every layer (the default), so only the others cost an evaluation after it
    uniform_plans = {c.name: layer_plan({n: c for n in targets(bench.base_model, c)}) for c in cands}
    whole = dict(layer_plan(choice).rules)  # the search's first plan: every layer in its first choice
    reused = {name for name, p in uniform_plans.items() if dict(p.rules) == whole}
    after = len(cands) - len(reused)
    result = search([s for s, _ in scored], limit.timed(_told(evaluator(bench, choice, min_cosine), budget, progress,
                                                              "")),
                    budget, alternatives(scored), stop=limit.stop(after=after))
    limit.saw(result)
    first = result.evaluations[0] if result.evaluations else None
    uniform = []
    for cand in cands:
        plan = uniform_plans[cand.name]
        why = f"{cand.name} on every layer it applies to"
        if first is not None and cand.name in reused:
            e = replace(first, why=why)
        else:
            timing, cos = bench.evaluate(plan)
            e = evaluation(frozenset(n for n, _ in plan.rules), timing, cos, cos >= min_cosine, why)
        uniform.append(evaluation_record(e, candidate=cand.name))
    best = result.best
    configs = chosen_configs(best.layers, choice) if best is not None else {}
    plan = replace(layer_plan(configs), name=f"{task_obj.name}-tuned",  # named even when it is fp32 throughout
                   summary="" if configs else NOTHING_CHOSEN)
    layers = _infer_layers(scored, configs, best is not None)
    evaluations = tuple(evaluation_record(e) for e in result.evaluations)
    return TuneReport(
        config=TuneConfig(task=spec, mode="infer", candidates=tuple(c.name for c in cands), min_cosine=min_cosine,
                          batch_size=bs, device=str(dev), budget=budget, task_name=task_obj.name),
        environment=environment(hw), plan=plan.to_dict(), speedup=best.speedup if best else 1.0,
        fidelity=best.fidelity if best else 1.0, layers=tuple(layers),
        evaluations=evaluations, uniform=tuple(uniform),
        front=tuple(evaluation_record(e) for e in result.front), base_s=bench.base_s,
        explanation="" if best else none_found(tuple(uniform), evaluations, hw,
                                                f"a worst output cosine of {min_cosine:g}", "worst cosine"),
        notes=disturbance_note(evaluations + tuple(uniform)) + limit.notes(budget))


def _tune_train(spec: str, task_obj: Task, cands: list[Plan], hw: HardwareInfo, tol: Tolerance, opts: TuneOptions,
                progress: Progress, limit: Limit) -> TuneReport:
    dev = torch.device(hw.device)
    probe_steps, seed = opts.probe_steps, opts.seed
    steps, bs = opts.steps or task_obj.steps, opts.batch_size or task_obj.batch_size
    progress(f"training fp32 for {steps} steps (the reference)")
    bench = TrainBench(task_obj, dev, steps, bs, tol, seed, probe_steps or 0)
    names = train_targets(bench.base.model)
    if not names:
        raise DtypelabError(f"no layer of {task_obj.name}'s model owns parameters: nothing to choose")
    for fmt in dict.fromkeys(RANGE_DTYPE(c.default) for c in cands if RANGE_DTYPE(c.default)):
        progress(f"range audit for {fmt}")
        bench.audits[fmt] = audit(task_obj, policy="fp32", steps=min(20, steps), formats=(fmt,), batch_size=bs,
                                  seed=seed, device=str(dev), hardware=hw)
    sign = 1.0 if task_obj.higher_is_better else -1.0
    budget = budget_for(len(names))
    found: list[tuple[Plan, Any, list[tuple[LayerScore, str]]]] = []
    for i, cand in enumerate(cands):
        share = limit.stop(share=1 / (len(cands) - i))  # each candidate left gets an equal part of the time left
        progress(f"{cand.name}: probing {len(names)} layers ({bench.probe_steps} steps each)")
        scored = bench.score(names, cand, on_layer=lambda n, c=cand: progress(f"{c.name}: probed {n}"))
        progress(f"{cand.name}: searching, at most {budget} full evaluations of {steps} steps")
        result = search([s for s, _ in scored], limit.timed(_told(train_evaluator(bench, cand, names), budget,
                                                                  progress, f"{cand.name}: ")), budget, stop=share)
        limit.saw(result)
        found.append((cand, result, scored))
    winners = [(c, r) for c, r, _ in found if r.best is not None]
    best_cand, best_result = max(winners, key=lambda cr: cr[1].best.speedup) if winners else (None, None)
    best = best_result.best if best_result is not None else None
    if best_cand is not None:
        plan = island_plan(best_cand, best.layers, names, name=f"{task_obj.name}-tuned")
    else:
        plan = Plan(Cast("float32"), name=f"{task_obj.name}-tuned", summary=NOTHING_CHOSEN)
    by_name = {c.name: {s.name: (s, verdict) for s, verdict in scored} for c, _, scored in found}
    shown = best_cand.name if best_cand is not None else cands[0].name
    layers = []
    for n in names:
        s, verdict = by_name[shown][n]
        tried = tuple((c, by_name[c][n][0].sensitivity, by_name[c][n][0].gain) for c in by_name)
        chosen = best is not None and n in best.layers
        extra = f"; audit: {verdict}" if verdict else ""
        layers.append(LayerChoice(n, s.config, s.sensitivity, s.gain, chosen,
                                  layer_why(s, chosen, best is not None, "per step, loss deviation", "fp32 island",
                                       extra), tried))
    evaluations = tuple(evaluation_record(e, sign, c.name) for c, r, _ in found for e in r.evaluations)
    uniform = tuple(evaluation_record(replace(e, why=f"{c.name} on every layer"), sign, c.name)
                    for c, r, _ in found for e in r.evaluations[:1])  # the search's first plan: all converted
    front = tuple(evaluation_record(e, sign) for e in pareto([e for _, r, _ in found for e in r.evaluations]))
    return TuneReport(
        config=TuneConfig(task=spec, mode="train", candidates=tuple(c.name for c in cands), min_cosine=0.0,
                          batch_size=bs, device=str(dev), budget=budget, task_name=task_obj.name,
                          metric=task_obj.metric, higher_is_better=task_obj.higher_is_better, tolerance=tol,
                          steps=steps, probe_steps=bench.probe_steps, base_metric=bench.base.metric),
        environment=environment(hw), plan=plan.to_dict(), speedup=best.speedup if best else 1.0,
        fidelity=sign * best.fidelity if best else bench.base.metric, layers=tuple(layers),
        evaluations=evaluations, uniform=uniform, front=front, base_s=bench.base_s,
        explanation="" if best else none_found(uniform, evaluations, hw, f"its {task_obj.metric} within {tol} of "
                                                f"fp32's ({bench.base.metric:.4g})", task_obj.metric),
        notes=disturbance_note(evaluations) + limit.notes(budget))


def apply_plan(model: torch.nn.Module, plan: str | Plan | dict[str, Any], device: str | None = None
               ) -> torch.nn.Module:
    """Your own model under a plan (a plan file, a policy name, a Plan): converted, each module in its config, and
    returned wrapped, never patched: calls run under the plan's precision (inputs converted, autocast when the plan
    asks), while ``isinstance``, ``state_dict`` keys, ``torch.save`` (your own class) and ``deepcopy`` are your
    model's. A plan that names modules the model lacks is an error naming them."""
    plan = plan_from_dict(plan) if isinstance(plan, dict) else get_policy(plan)
    dev = torch.device(device) if device else next((p.device for p in model.parameters()), torch.device("cpu"))
    precision = Precision(plan, dev)
    model = precision.convert_module(model.to(dev))
    return LabModule.wrap(model, _Applied(precision))


@dataclass(frozen=True)
class _Applied:
    """What ``apply_plan``'s wrapper does with each call: inputs converted, the plan's forward context."""

    precision: Precision

    def forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = self.precision.convert_input(args), self.precision.convert_input(kwargs)
        with self.precision.forward_context():
            return module(*args, **kwargs)
