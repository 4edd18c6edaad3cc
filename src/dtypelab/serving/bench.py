"""``bench TASK --mode generate``: each serving policy measured here, then the decision, by bench's rule.

Each policy runs in a child process of its own (baseline first: fp32 unless ``--baseline``): its memory counted on
real tensors, its greedy continuation, and the held-out text read through its cache (perplexity, the next-token
argmax at every position). Then every policy that completed is timed beside the others in one process, in
interleaved rounds of whole generations (``rounds``). A policy's gain is the baseline's seconds (or joules) over its
own, paired round by round, with an interval (``core.judging.generate``); the fastest policy whose perplexity stays
within ``--tolerance`` (one-sided: relative, 1%, or an absolute change) and whose interval clears the no-gain band is
chosen for ``--objective`` (decode tokens/s, prefill tokens/s, latency, or energy).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from dtypelab.core.energy import require_counter
from dtypelab.core.errors import DtypelabError
from dtypelab.core.judging.generate import judge_generation, steadiness_notes
from dtypelab.core.judging.notes import program_text
from dtypelab.core.machine.hardware import environment, hardware_for
from dtypelab.core.objectives import for_mode
from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.options import CALIBRATION_SAMPLES, parse_size
from dtypelab.core.policies import numerics_twin
from dtypelab.core.results import (
    GenerateConfig,
    GeneratePolicy,
    GenerateQuality,
    GenerateReport,
)
from dtypelab.core.results.parts import Conversion
from dtypelab.core.tolerance import Tolerance
from dtypelab.run import LAUNCHERS, Launcher, Outcome, ProcessLauncher
from dtypelab.serving.kv import attention_layers
from dtypelab.serving.measure import GenerateJob, Measured, program_path, program_shape, with_speeds
from dtypelab.serving.policies import DEFAULT_MEASURED, ServePolicy, serve_policies, serve_policy
from dtypelab.serving.quality import judge
from dtypelab.serving.rounds import ROUNDS, GenerateRounds, Timings
from dtypelab.serving.served import Served, encode, load_served
from dtypelab.serving.workload import Shape, first_divergence
from dtypelab.sweep import BenchOptions

Progress = Callable[[str, int, int], None]  # (policy, done, total)
QUALITY_SEQUENCES = 16

# what bench runs: the static engine, whichever engine a forecast names (--engine vllm forecasts a GPU)
STATIC_NOTE = ("measured with the static engine (one batch decoded in lockstep over a static cache, as gpt-fast and "
               "torchao's harness serve): vLLM does not run on this CPU; forecast --engine vllm --device GPU forecasts "
               "it")


def check_shape(shape: Shape, context: int, name: str, config: Any = None) -> None:
    """One line for a workload the model cannot hold (its positions; with its config, its cache's layout)."""
    if shape.prompt_len < 1 or shape.gen_len < 1 or shape.batch_size < 1:
        raise DtypelabError("--prompt-len, --gen-len and --batch-size must be at least 1")
    if shape.context > context:
        raise DtypelabError(f"--prompt-len {shape.prompt_len} + --gen-len {shape.gen_len} = {shape.context} tokens: "
                            f"{name} takes at most {context} (its positions)")
    if config is not None:
        attention_layers(config)  # one line for a layout the cache cannot hold


def _quality(value: Measured, base: Measured | None) -> GenerateQuality:
    ppl = math.exp(min(value.nats, 50.0))
    if base is None:
        return GenerateQuality(ppl, sequences=value.sequences)
    base_ppl = math.exp(min(base.nats, 50.0))
    mine, theirs = torch.tensor(value.argmax), torch.tensor(base.argmax)
    first, diverged = first_divergence(torch.tensor(value.tokens), torch.tensor(base.tokens))
    judged = judge(value.positions, base.positions, value.split) if value.positions and base.positions else None
    return GenerateQuality(ppl, ppl / base_ppl - 1.0, float((mine == theirs).float().mean()), first, diverged,
                           value.sequences, *((judged.kl, judged.top1, judged.change, judged.buckets) if judged
                                              else ()))


def _longest(policies: list[GeneratePolicy], budget: int | None, shape: Shape, context: int,
             numerics: set[str]) -> tuple[str, str]:
    """The policy that fits the longest context in ``budget`` bytes (this machine's memory when not given): the
    measured peak plus the cache's bytes per token for each token more, up to the model's positions."""
    best, best_len, best_room = "", -1, -1.0
    for p in policies:
        g = p.generate
        if p.status != "ok" or g is None or g.peak_bytes is None or not g.kv_bytes_per_token or budget is None or \
                p.policy in numerics:  # an emulation's memory is not its format's
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


@dataclass(frozen=True)
class Setup:
    """What every policy's measurement shares, from the options (validated once)."""

    spec: str
    opts: BenchOptions
    served: Served
    shape: Shape
    tolerance: Tolerance
    device: str
    objective: str
    plans: tuple[ServePolicy, ...]  # the baseline first
    launcher: Launcher
    hw: Any
    calibration: torch.Tensor | None = None  # token ids, when a calibrated method is measured
    calibration_words: str = ""
    reference: str = ""  # where the baseline's log-probabilities are written (a temporary folder)

    @property
    def base(self) -> str:
        return self.plans[0].name

    @property
    def numerics_only(self) -> set[str]:
        """The policies measured for their numerics only (an emulation, named or standing in): never timed."""
        return {p.name for p in self.plans if p.plan.numerics_only or not p.plan.availability(self.hw).ok}

    @classmethod
    def of(cls, spec: str, opts: BenchOptions) -> Setup:
        objective = opts.objective or "decode"
        if objective not in for_mode("generate"):
            raise DtypelabError(f"--objective {objective}: --mode generate chooses for "
                                f"{', '.join(for_mode('generate'))}")
        served = load_served(spec)
        shape = Shape(opts.prompt_len, opts.gen_len, opts.batch_size or 1)
        check_shape(shape, served.context, served.name, served.config)
        tol = Tolerance.parse(opts.tolerance)
        dev = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if objective_of(objective).counts_joules:
            require_counter(torch.device(dev))  # refused before the sweep, not after it
        chosen = serve_policies(_names(opts.policies), DEFAULT_MEASURED)
        base = serve_policy(opts.baseline or "fp32")
        given = opts.launcher
        launcher = LAUNCHERS[given] if isinstance(given, str) else (given or ProcessLauncher())
        plans = (base, *(p for p in chosen if p.name != base.name))
        calibrated = any(getattr(p.kv, "calibrated_by_text", False) or any(
            getattr(c, "calibrated", False) for c in p.plan.configs) for p in plans)
        if not calibrated and (opts.calibration or opts.calibration_samples != CALIBRATION_SAMPLES):
            raise DtypelabError("--calibration and --calibration-samples are read by calibrated policies only "
                                "(w4a16-gptq, w4a16-awq, w8a16-gptq, w8a16-awq, et-int8, POLICY+kv-fp8-cal): none is "
                                "named")
        ids, words = calibration_windows(served, opts.calibration, opts.calibration_samples,
                                         quality_len(shape, served.context)) if calibrated else \
            (None, "")
        return cls(spec, opts, served, shape, tol, dev, objective, plans, launcher,
                   hardware_for(torch.device(dev), None, budget_s=0.02), ids, words)


def _names(policies: Any) -> str | None:
    if policies is None or isinstance(policies, str):
        return policies
    if all(isinstance(p, str) for p in policies):
        return ",".join(policies)
    raise DtypelabError("--mode generate takes policy names (NAME[+kv-FORMAT]), not plans")


def serve_bench(spec: str, options: BenchOptions | None = None, *, on_progress: Progress | None = None,
                **settings: Any) -> GenerateReport:
    """Measure each serving policy on ``spec``'s model here; the record, judged. ``options`` (``BenchOptions``, its
    mode ``generate``) or its fields as keywords."""
    start = time.perf_counter()
    setup = Setup.of(spec, BenchOptions.build(options, **{"mode": "generate", **settings}))
    step = on_progress or (lambda name, done, total: None)
    total = len(setup.plans) + 1
    results: list[GeneratePolicy] = []
    base: Measured | None = None
    with tempfile.TemporaryDirectory(prefix="dtypelab-reference-") as folder:
        setup = replace(setup, reference=folder)
        for i, p in enumerate(setup.plans):
            result, measured = _one(setup, p, base, first=i == 0)
            base = measured if i == 0 else base
            results.append(result)
            step(p.name, i + 1, total)
        timings = _rounds(setup, results)  # in the folder's time: a program measured there is timed as written
    step("rounds", total, total)
    return _report(setup, _timed(setup, results, timings), timings, time.perf_counter() - start)


def _rounds(setup: Setup, results: list[GeneratePolicy]) -> Timings | str:
    """Every completed policy timed beside the others in interleaved rounds (its own process); why not, if not."""
    ran = [p for p in setup.plans if p.name not in setup.numerics_only
           and any(r.policy == p.name and r.status == "ok" for r in results)]
    rounds = ROUNDS if setup.opts.rounds is None else setup.opts.rounds
    if not ran or rounds == 0:
        return "--rounds 0: no timing rounds" if ran else "no policy completed"
    job = GenerateRounds(setup.spec, tuple((p.name, p.plan, p.kv.label) for p in ran), setup.shape, rounds,
                         setup.opts.seed, setup.device, setup.opts.threads,
                         program_shape(setup.shape, quality_len(setup.shape, setup.served.context)),
                         None if setup.calibration is None else setup.calibration.tolist(),
                         tuple((p.name, path) for p in ran
                               if os.path.exists(path := program_path(setup.reference, p.name))))
    outcome: Outcome = setup.launcher.run(job, setup.opts.timeout_s * len(ran), lambda done, total: None)
    if outcome.status != "ok":
        return f"the timing rounds {outcome.status}: {outcome.reason}"
    assert isinstance(outcome.value, Timings)
    return outcome.value


def _timed(setup: Setup, results: list[GeneratePolicy], timings: Timings | str) -> list[GeneratePolicy]:
    """Each policy's figures with its rounds' speeds (the median round's) and energy."""
    if isinstance(timings, str):
        return results
    out = []
    for r in results:
        t = timings.policies.get(r.policy)
        if t is None or r.generate is None:
            out.append(r)
            continue
        g = replace(r.generate, ttft_runs_s=t.ttft_runs_s, decode_runs_s=t.decode_runs_s, blocks=t.blocks,
                    disturbed_runs=sum(b.disturbed for b in t.blocks), energy=t.energy, energy_runs=t.energy_runs)
        out.append(replace(r, generate=with_speeds(g, setup.shape, statistics.median(t.ttft_runs_s),
                                                   statistics.median(t.decode_runs_s))))
    return out


def _report(setup: Setup, results: list[GeneratePolicy], timings: Timings | str, seconds: float) -> GenerateReport:
    opts, shape, served = setup.opts, setup.shape, setup.served
    source = timings.energy_source if isinstance(timings, Timings) else None
    judged = judge_generation(results, setup.base, setup.tolerance, setup.objective, shape.gen_len)
    best, sentence = judged.chosen, judged.sentence
    measured = any(p.generate and p.generate.energy for p in judged.policies)
    if objective_of(setup.objective).counts_joules and not measured:
        best, sentence = "", ("no recommendation: --objective energy needs measured energy, and none was measured"
                              f" ({source.why if source else 'no policy completed'})")
    budget = parse_size(opts.memory_budget, "--memory-budget") or _memory_here(setup.device)
    longest, longest_sentence = _longest(list(judged.policies), budget, shape, served.context, setup.numerics_only)
    notes = [n for n in (*steadiness_notes(list(judged.policies), setup.objective), longest_sentence,
                         "" if isinstance(timings, Timings) else f"not timed: {timings}",
                         "" if served.trained else
                         f"{served.name} is untrained here: its quality figures say nothing of a trained model's",
                         STATIC_NOTE)
             if n]
    report = GenerateReport(
        GenerateConfig(setup.spec, served.name, "measured", shape.prompt_len, shape.gen_len, shape.batch_size,
                       objective=setup.objective, tolerance=str(setup.tolerance), baseline=setup.base,
                       context_limit=served.context, calibration=setup.calibration_words),
        judged.policies, environment(setup.hw), sentence, best, longest, tuple(notes), seconds,
        time.strftime("%Y-%m-%dT%H:%M:%S"), energy_source=source, decision=judged.decision)
    if opts.json_path:
        report.save(opts.json_path)
    return report


def _memory_here(device: str) -> int | None:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _stand_in(setup: Setup, p: ServePolicy) -> tuple[ServePolicy, str] | str:
    """The policy as measured here: itself, or where its kernels are missing its emulation (numerics only, never
    timed), said in a note; why neither, if neither."""
    avail = p.plan.availability(setup.hw)
    if avail.ok:
        return p, ("slow here: " + avail.reason) if avail.slow else ""
    twin = numerics_twin(p.plan)
    if twin is None or not twin.availability(setup.hw).ok:
        return f"{avail.reason} (forecast it: dtypelab forecast --mode generate --device GPU)"
    return (ServePolicy(p.name, twin, p.kv),
            f"measured as its emulation {twin.name} ({avail.reason}): its numerics only, not timed, its memory the "
            "emulation's "
            "(forecast its speed and bytes: dtypelab forecast --mode generate --device GPU)")


def _one(setup: Setup, p: ServePolicy, base: Measured | None, first: bool = False) -> tuple[GeneratePolicy,
                                                                                         Measured | None]:
    """One policy's memory and quality, in a process of its own (the baseline's first: it writes the log-probabilities
    the others are judged against)."""
    here = _stand_in(setup, p)
    if isinstance(here, str):
        return GeneratePolicy(p.name, p.describe(), "skipped", here), None
    runs, note = here
    shape = setup.shape
    job = GenerateJob(setup.spec, runs.plan, p.kv.label, p.name, shape, QUALITY_SEQUENCES,
                      quality_len(shape, setup.served.context), setup.opts.seed, setup.device, setup.opts.threads,
                      setup.reference, first, None if setup.calibration is None else setup.calibration.tolist())
    outcome = setup.launcher.run(job, setup.opts.timeout_s, lambda done, total: None)
    if outcome.status != "ok":
        return GeneratePolicy(p.name, runs.describe(), "failed", outcome.reason, seconds=outcome.wall_s), None
    value = outcome.value
    assert isinstance(value, Measured)
    conversion = cast(Conversion, value.conversion)
    notes = tuple(n for n in (note, _scales_note(p.kv, value.kv_scales), _program_note(p.name, conversion, shape))
                  if n)
    stand_in = runs.plan.name if runs is not p else ""
    return GeneratePolicy(p.name, runs.describe(), "ok", generate=value.figures, quality=_quality(value, base),
                          notes=notes, seconds=outcome.wall_s, measured_as=stand_in, conversion=conversion), value


def _program_note(policy: str, conversion: Conversion, shape: Shape) -> str:
    """A generation program's delegation, and the shape it was exported for where it differs from the others'."""
    if not conversion.get("max_len"):
        return ""
    text = program_text(policy, conversion).removeprefix(f"{policy}: ").removesuffix(".")  # its row names it
    longer = conversion["max_len"] > shape.context
    return text + (f"; exported for {conversion.get('batch')} sequence(s) and a cache of {conversion['max_len']} "
                   "positions" + (f" (the held-out windows' length; the others' caches hold {shape.context})"
                                  if longer else "") + ", its keys and values inside the program.")


def _scales_note(fmt: Any, scales: list[tuple[float, float]] | None) -> str:
    """A calibrated KV format's scales, layer by layer, as the largest magnitudes they map to the format's largest
    value: where they sit far from it, scale 1.0 saturates (above) or loses precision (far below)."""
    if not scales:
        return ""
    top = float(torch.finfo(fmt.storage).max)
    layers = "; ".join(f"{i}: keys {k * top:.3g}, values {v * top:.3g}" for i, (k, v) in enumerate(scales))
    return (f"{fmt.label}'s calibrated scales map these largest magnitudes to {top:g} (scale 1.0 saturates above "
            f"{top:g}), by layer: {layers}")


def quality_len(shape: Shape, context: int) -> int:
    """The held-out windows' length: the workload's context, at least twice the prompt, within the positions."""
    return min(context, max(2 * shape.prompt_len, shape.context))


CALIBRATION_LEN = 512  # tokens per calibration window (llm-compressor's examples use 512 to 2048)


def calibration_windows(served: Served, file: str | None, n: int, length: int) -> tuple[torch.Tensor, str]:
    """``n`` calibration windows, and in words: ``--calibration FILE`` in the model's tokens, or held-out windows
    none of which is one of the windows (of ``length``) quality is judged on."""
    size = min(CALIBRATION_LEN, served.context)
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise DtypelabError(f"--calibration {file}: {exc}") from None
        ids = encode(served, text)
        if len(ids) < size:
            raise DtypelabError(f"--calibration {file}: {len(ids)} tokens, fewer than one window of {size}")
        count = min(n, len(ids) // size)
        return ids[:count * size].reshape(count, size), f"{file}: {count} windows of {size} tokens"
    judged = served.text(QUALITY_SEQUENCES, length)
    # where the text spreads its windows evenly, the odd ones of 2m (m a multiple of the judged count) start halfway
    # between judged ones: apart from them while a window is shorter than that gap
    m = QUALITY_SEQUENCES * -(-n // QUALITY_SEQUENCES)
    spread = served.text(2 * m, size)[1::2][:n]
    kept = [w for w in spread if not any(torch.equal(w[:min(size, length)], j[:min(size, length)]) for j in judged)]
    if not kept:
        raise DtypelabError(f"{served.name}'s held-out text has no window apart from those quality is judged on: "
                            "give --calibration FILE")
    return torch.stack(kept), (f"{len(kept)} held-out windows of {size} tokens apart from the {len(judged)} quality "
                               "is judged on")


__all__ = ["calibration_windows", "check_shape", "quality_len", "serve_bench"]
