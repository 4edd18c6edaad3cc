"""Serving records: a causal language model generating tokens under each policy (a weight format, a KV-cache
format), measured here (``bench --mode generate``) or forecast for a device (``forecast --mode generate``).

Every policy's figures are in ``policies[].generate`` (``GenerateFigures``): the peak and its parts (weights, KV
cache, activations), prefill and decode tokens per second, whether it fits, and what bounds decoding. A measured
record adds quality against the baseline on held-out text (``GenerateQuality``) and the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dtypelab.core.results.energy import Energy, EnergySource
from dtypelab.core.results.forecast import TargetDevice
from dtypelab.core.results.store import Record

GENERATE_SCHEMA = "dtypelab.generate"
GENERATE_VERSION = 2  # 2: energy (each policy's ``generate.energy``, the record's ``energy_source``)
OBJECTIVES = {"decode": "decode tokens per second", "prefill": "prefill tokens per second",
              "latency": "time to first token plus the generation's per-token latency",
              "energy": "the least energy per generated token"}


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
    # measured: each timed generation's prefill and decode seconds (a speed verdict needs their spans to separate)
    ttft_runs_s: tuple[float, ...] = ()
    decode_runs_s: tuple[float, ...] = ()
    # forecast: the prefill's and a decode step's seconds by what bounds them (compute, memory, overhead)
    prefill_bounds: dict[str, float] = field(default_factory=dict)
    decode_bounds: dict[str, float] = field(default_factory=dict)
    # a generation's energy (joules per step: one generation of the batch), measured or forecast
    energy: Energy | None = None
    energy_runs: tuple[float, ...] = ()  # measured: each window's joules per generated token
    # measured: the timed generations during which other processes took the CPU (core.disturbance): no speed verdict
    # rests on them
    disturbed_runs: int = 0


@dataclass(frozen=True)
class GenerateQuality:
    """Against the baseline, on held-out text the prompt comes from."""

    perplexity: float
    perplexity_change: float | None = None  # relative to the baseline's (0.01: 1% higher)
    agreement: float | None = None  # share of positions whose next-token argmax matches the baseline's
    first_divergence: float | None = None  # mean position where greedy continuations first differ (gen_len: none)
    diverged: int = 0  # sequences whose greedy continuation differs anywhere
    sequences: int = 0


@dataclass(frozen=True)
class GeneratePolicy:
    policy: str
    summary: str
    status: str  # ok, skipped, failed
    reason: str = ""
    generate: GenerateFigures | None = None
    quality: GenerateQuality | None = None
    verdict: str = ""  # measured: chosen, within, worse (", tie" or ", disturbed" after), baseline; "" for a forecast
    notes: tuple[str, ...] = ()
    check: GenerateFigures | None = None  # --check: the same workload measured here
    seconds: float = 0.0


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

    schema_version: int = GENERATE_VERSION

    schema = GENERATE_SCHEMA
    version = GENERATE_VERSION
    migrations: ClassVar[dict[int, Any]] = {1: lambda d: d}  # version 1 had no energy: nothing to fill

    def result(self, policy: str) -> GeneratePolicy:
        for p in self.policies:
            if p.policy == policy:
                return p
        raise KeyError(policy)
