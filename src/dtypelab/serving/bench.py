"""``bench TASK --mode generate``: each serving policy measured here, one child process each, then the decision.

The baseline runs first (fp32 unless ``--baseline``); every other policy's quality is read against it on the same
held-out windows (perplexity through the cache, the next-token argmax at every position, the greedy
continuation). The fastest policy whose perplexity stays within ``--tolerance`` (one-sided: relative, 1%, or an
absolute change) is chosen for ``--objective`` (decode tokens/s, prefill tokens/s, or latency). Its speed is the
median of ``repeats`` timed generations inside one run: a speedup is claimed only where the slowest of one
policy's generations beats the fastest of the other's (the spans do not overlap); otherwise it is a tie.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dtypelab.core.energy import require_counter
from dtypelab.core.errors import DtypelabError
from dtypelab.core.hardware import environment, hardware_for
from dtypelab.core.results import (
    OBJECTIVES,
    GenerateConfig,
    GenerateFigures,
    GeneratePolicy,
    GenerateQuality,
    GenerateReport,
)
from dtypelab.core.tolerance import Tolerance, judge
from dtypelab.run import LAUNCHERS, Launcher, ProcessLauncher
from dtypelab.serving.kv import attention_layers
from dtypelab.serving.measure import GenerateJob
from dtypelab.serving.policies import DEFAULT_MEASURED, ServePolicy, serve_policies, serve_policy
from dtypelab.serving.served import load_served
from dtypelab.serving.workload import Shape, first_divergence

Progress = Callable[[str, int, int], None]  # (policy, done, total)
REPEATS = 3
QUALITY_SEQUENCES = 16


def check_shape(shape: Shape, context: int, name: str, config: Any = None) -> None:
    """One line for a workload the model cannot hold (its positions; with its config, its cache's layout)."""
    if shape.prompt_len < 1 or shape.gen_len < 1 or shape.batch_size < 1:
        raise DtypelabError("--prompt-len, --gen-len and --batch-size must be at least 1")
    if shape.context > context:
        raise DtypelabError(f"--prompt-len {shape.prompt_len} + --gen-len {shape.gen_len} = {shape.context} tokens: "
                            f"{name} takes at most {context} (its positions)")
    if config is not None:
        attention_layers(config)  # one line for a layout the cache cannot hold


def objective_value(f: GenerateFigures, objective: str, gen_len: int) -> float:
    """Higher is better for every objective (latency and energy: their inverse)."""
    if objective == "energy":
        jpt = f.energy.joules_per_token if f.energy else None
        return 1.0 / jpt if jpt else 0.0
    if objective == "prefill":
        return f.prefill_tok_s or 0.0
    if objective == "latency":
        total = (f.ttft_s or 0.0) + (gen_len - 1) * (f.token_latency_s or 0.0)
        return 1.0 / total if total > 0 else 0.0
    return f.decode_tok_s or 0.0


def _span(f: GenerateFigures, objective: str) -> tuple[float, float]:
    """The slowest and fastest of the timed generations, as seconds of what the objective counts (lower: faster);
    for energy, the most and least joules per token of the counter's windows."""
    if objective == "energy":
        return (max(f.energy_runs), min(f.energy_runs)) if f.energy_runs else (math.inf, 0.0)
    runs = {"prefill": f.ttft_runs_s, "decode": f.decode_runs_s}.get(objective) or tuple(
        a + b for a, b in zip(f.ttft_runs_s, f.decode_runs_s, strict=True))
    return (max(runs), min(runs)) if runs else (math.inf, 0.0)


def separated(f: GenerateFigures, base: GenerateFigures, objective: str) -> bool:
    """Faster beyond doubt: the slowest of its generations beat the fastest of the baseline's, none of either timed
    while other processes took the CPU (a busy neighbour slows whichever it overlaps: a baseline slowed 10x makes any
    quiet policy "faster")."""
    return not (f.disturbed_runs or base.disturbed_runs) and _span(f, objective)[0] < _span(base, objective)[1]


UNSTEADY = 2.0  # a policy whose slowest timed generation took this many times its fastest is said to be unsteady


def steadiness_notes(policies: list[GeneratePolicy], objective: str) -> list[str]:
    """What a reader must know of the timings' evidence: the policies timed beside a busy process (no speed verdict
    for them or against them), and those whose generations' times spread past UNSTEADY."""
    timed = [p for p in policies if p.status == "ok" and p.generate is not None]
    busy = [p.policy for p in timed if p.generate.disturbed_runs]  # type: ignore[union-attr]
    notes = [f"other processes took the CPU while {', '.join(busy)} {'was' if len(busy) == 1 else 'were'} timed: "
             "no policy is called faster than a disturbed baseline, nor a disturbed policy faster than it (rerun on a "
             "quiet machine)"] if busy else []
    spread = []
    for p in timed:
        slow, fast = _span(p.generate, objective)  # type: ignore[arg-type]
        if fast > 0 and math.isfinite(slow) and slow / fast > UNSTEADY:
            spread.append(f"{p.policy} {slow / fast:.1f}x")
    if spread:
        notes.append(f"unsteady timings (slowest over fastest timed generation): {', '.join(spread)}")
    return notes


def _quality(value: dict[str, Any], base: dict[str, Any] | None) -> GenerateQuality:
    ppl = math.exp(min(value["nats"], 50.0))
    if base is None:
        return GenerateQuality(ppl, sequences=value["sequences"])
    base_ppl = math.exp(min(base["nats"], 50.0))
    mine, theirs = torch.tensor(value["argmax"]), torch.tensor(base["argmax"])
    first, diverged = first_divergence(torch.tensor(value["tokens"]), torch.tensor(base["tokens"]))
    return GenerateQuality(ppl, ppl / base_ppl - 1.0, float((mine == theirs).float().mean()), first, diverged,
                           value["sequences"])


def _sentence(best: str, base: str, tol: Tolerance, objective: str, ratio: float) -> str:
    if objective == "energy":
        return (f"{best}: the least energy per generated token ({1 / ratio:.2f}x {base}'s joules) with perplexity "
                f"within {tol} of {base}" if best != base else
                f"{base}: no policy within {tol} of its perplexity used less energy per token beyond doubt (every "
                "window of it below each of the baseline's)")
    return (f"{best}: the fastest for {objective} ({ratio:.2f}x {base}) with perplexity within {tol} of {base}"
            if best != base else f"{base}: no policy within {tol} of its perplexity was faster for {objective} "
                                  "beyond doubt (every timed generation faster than each of the baseline's)")


def _verdicts(policies: list[GeneratePolicy], base: str, tol: Tolerance, objective: str, gen_len: int,
              ) -> tuple[list[GeneratePolicy], str, str]:
    """Each policy's verdict, the chosen one and the decision in a sentence."""
    baseline = next((p for p in policies if p.policy == base and p.status == "ok"), None)
    if baseline is None or baseline.quality is None:
        return policies, "", f"the {base} baseline did not complete: nothing to judge the policies against"
    out, best, best_speed = [], base, objective_value(baseline.generate, objective, gen_len)  # type: ignore[arg-type]
    for p in policies:
        if p.status != "ok" or p.quality is None or p.generate is None:
            out.append(p)
            continue
        if p.policy == base:
            out.append(replace(p, verdict="baseline"))
            continue
        ok, how = judge(p.quality.perplexity, baseline.quality.perplexity, tol, False, base)
        speed = objective_value(p.generate, objective, gen_len)
        faster = separated(p.generate, baseline.generate, objective)  # type: ignore[arg-type]
        del how  # the perplexity's change is its own column
        busy = bool(p.generate.disturbed_runs or baseline.generate.disturbed_runs)  # type: ignore[union-attr]
        verdict = ("within" if ok else "worse") + ("" if faster else ", disturbed" if busy else ", tie")
        if ok and faster and speed > best_speed:
            best, best_speed = p.policy, speed
        out.append(replace(p, verdict=verdict))
    out = [replace(p, verdict="baseline, kept" if p.verdict == "baseline" else "chosen") if p.policy == best else p
           for p in out]
    chosen = next(p for p in out if p.policy == best)
    ratio = best_speed / objective_value(baseline.generate, objective, gen_len) if best != base else 1.0  # type: ignore[arg-type]
    sentence = _sentence(best, base, tol, objective, ratio)
    if chosen.quality is not None and chosen.quality.perplexity_change is not None and best != base:
        sentence += f" ({chosen.quality.perplexity_change:+.2%})"
    return out, best, sentence


def _longest(policies: list[GeneratePolicy], budget: int | None, shape: Shape, context: int) -> tuple[str, str]:
    """The policy that fits the longest context in ``budget`` bytes (this machine's memory when not given): the
    measured peak plus the cache's bytes per token for each token more, up to the model's positions."""
    best, best_len, best_room = "", -1, -1.0
    for p in policies:
        g = p.generate
        if p.status != "ok" or g is None or g.peak_bytes is None or not g.kv_bytes_per_token or budget is None:
            continue
        per_token = g.kv_bytes_per_token * shape.batch_size
        room = shape.context + (budget - g.peak_bytes) / per_token  # the longest before the model's positions cap it
        if room > best_room:
            best, best_len, best_room = p.policy, min(context, int(room)), room
    if not best or budget is None:
        return "", ""
    capped = f" (its positions; the memory would hold {int(best_room):,})" if best_room > context else ""
    return best, (f"{best} fits the longest context in {budget / 2**30:.3g} GiB: {best_len:,} tokens at batch "
                  f"{shape.batch_size}{capped}, from its cache's bytes per token over the measured peak")


def serve_bench(spec: str, shape: Shape, policies: str | None = None, *, baseline: str | None = None,
                tolerance: str = "1%", objective: str = "decode", device: str | None = None, seed: int = 0,
                threads: int | None = None, repeats: int = REPEATS, memory_budget: int | None = None,
                timeout_s: float = 600.0, launcher: str | Launcher | None = None, json_path: str | None = None,
                on_progress: Progress | None = None) -> GenerateReport:
    """Measure each serving policy on ``spec``'s model here; the record, judged."""
    start = time.perf_counter()
    if objective not in OBJECTIVES:
        raise DtypelabError(f"--objective {objective}: --mode generate chooses for {', '.join(OBJECTIVES)}")
    served = load_served(spec)
    check_shape(shape, served.context, served.name, served.config)
    tol = Tolerance.parse(tolerance)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if objective == "energy":
        require_counter(torch.device(dev))  # refused before the sweep, not after it
    hw = hardware_for(torch.device(dev), None, budget_s=0.02)
    chosen = serve_policies(policies, DEFAULT_MEASURED)
    base = serve_policy(baseline or "fp32")
    plans = [base, *(p for p in chosen if p.name != base.name)]
    run = LAUNCHERS[launcher] if isinstance(launcher, str) else (launcher or ProcessLauncher())
    quality_len = min(served.context, max(2 * shape.prompt_len, shape.context))
    results: list[GeneratePolicy] = []
    values: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(plans):
        results.append(_one(p, spec, shape, hw, run, timeout_s, seed, dev, threads, repeats, quality_len, values,
                            values.get(base.name)))
        if on_progress is not None:
            on_progress(p.name, i + 1, len(plans))
    source = next((v["energy_source"] for v in values.values() if v.get("energy_source")), None)
    judged, best, sentence = _verdicts(results, base.name, tol, objective, shape.gen_len)
    if objective == "energy" and not any(p.generate and p.generate.energy for p in judged):
        best, sentence = "", ("no recommendation: --objective energy needs measured energy, and none was measured"
                              f" ({source.why if source else 'no policy completed'})")
    budget = memory_budget or _memory_here(dev)
    longest, longest_sentence = _longest(judged, budget, shape, served.context)
    notes = [n for n in (*steadiness_notes(judged, objective), longest_sentence, "" if served.trained else
                         f"{served.name} is untrained here: its quality figures say nothing of a trained model's")
             if n]
    report = GenerateReport(
        GenerateConfig(spec, served.name, "measured", shape.prompt_len, shape.gen_len, shape.batch_size,
                       objective=objective, tolerance=str(tol), baseline=base.name, context_limit=served.context),
        tuple(judged), environment(hw), sentence, best, longest, tuple(notes), time.perf_counter() - start,
        time.strftime("%Y-%m-%dT%H:%M:%S"), energy_source=source)
    if json_path:
        report.save(json_path)
    return report


def _memory_here(device: str) -> int | None:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _one(p: ServePolicy, spec: str, shape: Shape, hw: Any, run: Launcher, timeout_s: float, seed: int, dev: str,
         threads: int | None, repeats: int, quality_len: int, values: dict[str, dict[str, Any]],
         base: dict[str, Any] | None) -> GeneratePolicy:
    avail = p.plan.availability(hw)
    if not avail.ok:
        return GeneratePolicy(p.name, p.describe(), "skipped", f"{avail.reason} (forecast it: dtypelab forecast "
                                                                f"--mode generate --device GPU)")
    job = GenerateJob(spec, p.plan, p.kv.label, p.name, shape, repeats, QUALITY_SEQUENCES, quality_len, seed, dev,
                      threads)
    outcome = run.run(job, timeout_s, lambda done, total: None)
    if outcome.status != "ok":
        return GeneratePolicy(p.name, p.describe(), "failed", outcome.reason, seconds=outcome.wall_s)
    value = outcome.value
    values[p.name] = value
    notes = ("slow here: " + avail.reason,) if avail.slow else ()
    return GeneratePolicy(p.name, p.describe(), "ok", generate=value["figures"], quality=_quality(value, base),
                          notes=notes, seconds=outcome.wall_s)


__all__ = ["check_shape", "serve_bench"]
