"""Serving records: a causal language model generating tokens under each policy (a weight format, a KV-cache
format), measured here (``bench --mode generate``) or forecast for a device (``forecast --mode generate``).

Every policy's figures are in ``policies[].generate`` (``GenerateFigures``): the peak and its parts (weights, KV
cache, activations), prefill and decode tokens per second, whether it fits, and what bounds decoding. A measured
record adds quality against the baseline on held-out text (``GenerateQuality``) and the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dtypelab.core.results.decision import Decision, Verdict
from dtypelab.core.results.energy import Energy, EnergySource
from dtypelab.core.results.forecast import TargetDevice
from dtypelab.core.results.parts import Conversion, RoundBlock, SpeedupInterval
from dtypelab.core.results.store import Record

GENERATE_SCHEMA = "dtypelab.generate"
# 2: energy (each policy's ``generate.energy``, the record's ``energy_source``); 3: the speed verdicts as codes
# (``Verdict``) from paired, interleaved rounds (``generate.blocks``, ``gain``), the decision as a code; 4: the
# serving engine (``config.engine``, its settings; a paged engine's KV capacity, concurrency and curve per policy);
# 5: quality as users judge it (KL divergence, top-1 agreement and the perplexity change, each with a bootstrap
# interval over documents, whole and by context bucket), a policy measured as its emulation, the calibration text
GENERATE_VERSION = 5


@dataclass(frozen=True)
class CurvePoint:
    """A paged engine's steady state at one concurrency (forecast): the requests running (at most what the KV cache
    holds), their generated tokens a second, a step's seconds by what bounds them, and joules per generated token."""

    concurrency: int
    running: int
    tok_s: float
    step_bounds: dict[str, float] = field(default_factory=dict)
    joules_per_token: float | None = None


@dataclass(frozen=True)
class GenerateFigures:
    """One policy's serving figures (bytes; seconds; tokens per second over all sequences of the batch)."""

    peak_bytes: int | None = None  # the higher of the prefill's and the decode's peak
    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None  # the cache for the whole context (prompt + generated), as allocated
    activations_bytes: int | None = None  # at the peak: everything but weights and cache (logits included)
    prefill_peak_bytes: int | None = None
    decode_peak_bytes: int | None = None  # decoding the last token, with the whole context cached
    ttft_s: float | None = None  # time to first token: the prefill and its first token
    prefill_tok_s: float | None = None  # prompt tokens per second over the batch
    decode_tok_s: float | None = None  # generated tokens per second over the batch, averaged over the generation
    token_latency_s: float | None = None  # one decode step (one token for each sequence)
    fits: bool | None = None
    bound: str = ""  # what bounds decoding: memory, compute or overhead
    prefill_bound: str = ""
    largest_batch: int | None = None  # the most sequences that fit at this context (0: none; None: not searched)
    longest_context: int | None = None  # the longest context that fits at this batch (0: none; None: not searched)
    kernels: tuple[str, ...] = ()  # what each matmul kind runs (forecast)
    bandwidth_share: float | None = None  # decode: the share of the device's bandwidth its bytes move at
    flops_share: float | None = None  # decode: the share of its peak FLOP/s reached
    kv_bytes_per_token: int | None = None  # one token of context in the cache, every layer
    # measured: each interleaved round's prefill and decode seconds (the median generation of its block), and its
    # blocks (the round, its generations, the energy counter's joules over them, whether other processes took the
    # CPU): a speed verdict pairs a policy's rounds with the baseline's (core.judging.generate)
    ttft_runs_s: tuple[float, ...] = ()
    decode_runs_s: tuple[float, ...] = ()
    blocks: tuple[RoundBlock, ...] = ()
    # forecast: the prefill's and a decode step's seconds by what bounds them (compute, memory, overhead)
    prefill_bounds: dict[str, float] = field(default_factory=dict)
    decode_bounds: dict[str, float] = field(default_factory=dict)
    # a generation's energy (joules per step: one generation of the batch), measured or forecast
    energy: Energy | None = None
    energy_runs: tuple[float, ...] = ()  # measured: each round's joules per generated token
    # measured: the rounds during which other processes took the CPU (core.disturbance): left out of the pairing
    # while enough quiet ones remain
    disturbed_runs: int = 0
    # a paged engine's (forecast, ``--engine vllm``): its KV cache's tokens on each card ("GPU KV cache size") and
    # the requests of --max-model-len it holds at once ("Maximum concurrency"); its steady state at each concurrency
    # read; the concurrency from which it no longer beats the baseline, in tokens a second and in joules per token
    # (None: it beats it at every one read; 1: at none)
    kv_capacity_tokens: int | None = None
    max_concurrency: float | None = None
    engine_memory: dict[str, int] = field(default_factory=dict)  # one card's budget, weights, activation, ...
    curve: tuple[CurvePoint, ...] = ()
    stops_paying: dict[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    """A figure over the held-out documents with its bootstrap 95% interval (documents resampled)."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class QualityBucket:
    """Quality at the positions whose context holds ``start`` to ``end`` tokens (the token predicted is the next)."""

    start: int
    end: int
    tokens: int  # positions scored in the bucket, over every document
    kl: Estimate | None = None  # mean KL divergence (nats) from the baseline's next-token distribution
    top1: Estimate | None = None  # share of positions whose most likely next token is the baseline's
    perplexity_change: Estimate | None = None  # relative to the baseline's perplexity at the same positions


@dataclass(frozen=True)
class GenerateQuality:
    """Against the baseline, on held-out text the prompt comes from."""

    perplexity: float
    perplexity_change: float | None = None  # relative to the baseline's (0.01: 1% higher)
    agreement: float | None = None  # share of positions whose next-token argmax matches the baseline's
    first_divergence: float | None = None  # mean position where greedy continuations first differ (gen_len: none)
    diverged: int = 0  # sequences whose greedy continuation differs anywhere
    sequences: int = 0
    # over the continuation's positions (the perplexity's), with bootstrap 95% intervals over the documents
    kl: Estimate | None = None
    top1: Estimate | None = None
    change: Estimate | None = None  # the perplexity change's interval
    buckets: tuple[QualityBucket, ...] = ()  # every position of the held-out text, by context length


@dataclass(frozen=True)
class GeneratePolicy:
    policy: str
    summary: str
    status: str  # ok, skipped, failed
    reason: str = ""
    generate: GenerateFigures | None = None
    quality: GenerateQuality | None = None
    # measured: recommended, baseline, within (accepted, measurably faster), no-gain (accepted, its interval reaches
    # no gain), outside (its perplexity past the tolerance), untimed (no rounds to judge it by); None for a forecast
    verdict: Verdict | None = None
    gain: SpeedupInterval | None = None  # measured: the baseline's objective over this policy's, paired rounds
    notes: tuple[str, ...] = ()
    check: GenerateFigures | None = None  # --check: the same workload measured here
    seconds: float = 0.0
    # measured: what ran for it where its kernels are missing here (int4-wo-emu for int4-wo), numerics only
    measured_as: str = ""
    # a generation program's (ExecuTorch): as a bench record's, with the shape it was exported for
    conversion: Conversion = field(default_factory=lambda: Conversion())


@dataclass(frozen=True)
class GenerateConfig:
    task: str
    task_name: str
    source: str  # measured or forecast
    prompt_len: int
    gen_len: int
    batch_size: int
    device: TargetDevice | None = None
    objective: str = "decode"
    tolerance: str = ""
    baseline: str = ""
    parameters: int = 0
    context_limit: int = 0  # the model's positions
    engine: str = "static"  # the serving program forecast: static (one batch in lockstep) or vllm (paged)
    engine_settings: dict[str, Any] = field(default_factory=dict)  # its flags, as vLLM spells them
    calibration: str = ""  # measured: the text calibrated methods (GPTQ, AWQ) read, in words


@dataclass(frozen=True)
class GenerateReport(Record):
    config: GenerateConfig
    policies: tuple[GeneratePolicy, ...]
    environment: dict[str, Any] = field(default_factory=dict)
    answer: str = ""  # the decision (measured) or the forecast in a sentence
    chosen: str = ""  # the fastest policy within tolerance (measured) or predicted to fit (forecast)
    longest: str = ""  # the policy that fits the longest context
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    created: str = ""
    rates: str = ""  # where the forecast's rates come from
    energy_source: EnergySource | None = None  # measured: what read the energy, or why nothing did
    energy_note: str = ""  # forecast: the power model the energy comes from, or why there is none
    # forecast: the bands of its figures from the validation set's held-out cases (core.bands; 0: none claimed):
    # decode tokens a second, a format's speed against another's (a tie within it), the peak and KV cache, joules
    speed_error: float = 0.0
    ratio_error: float = 0.0
    memory_error: float = 0.0
    energy_error: float = 0.0
    decision: Decision | None = None  # measured: use the chosen policy, keep the baseline, or no baseline

    schema_version: int = GENERATE_VERSION

    schema = GENERATE_SCHEMA
    version = GENERATE_VERSION
    # version 1 had no energy: nothing to fill
    migrations: ClassVar[dict[int, Any]] = {1: lambda d: d, 2: lambda d: _migrate_v2(d), 3: lambda d: d,
                                            4: lambda d: d}

    def result(self, policy: str) -> GeneratePolicy:
        for p in self.policies:
            if p.policy == policy:
                return p
        raise KeyError(policy)


# version 2's words for a verdict, as codes: its speeds were spans of one process's generations (a "tie" where they
# overlapped), which version 3 reads as no gain
_V2_VERDICTS = {"chosen": "recommended", "baseline": "baseline", "baseline, kept": "baseline", "within": "within",
                "worse": "outside"}


def _migrate_v2(d: dict[str, Any]) -> dict[str, Any]:
    """Version 2 said each verdict in words; ``""`` (a forecast) is no verdict."""
    def code(words: str) -> str | None:
        if not words:
            return None
        return _V2_VERDICTS.get(words) or ("outside" if words.startswith("worse") else "no-gain")

    chosen = d.get("chosen") or ""
    measured = (d.get("config") or {}).get("source") == "measured"
    decision = None if not measured else "no-baseline" if not chosen else \
        "keep-baseline" if chosen == (d.get("config") or {}).get("baseline") else "use"
    return {**d, "decision": decision,
            "policies": [{**p, "verdict": code(p.get("verdict") or "")} for p in d.get("policies") or []]}
