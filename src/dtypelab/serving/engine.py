"""``forecast --mode generate --engine vllm``: serving as vLLM serves, nothing run.

It follows **vLLM v0.11** (its V1 engine): ``vllm/v1/worker/gpu_worker.py`` (``determine_available_memory``),
``vllm/v1/core/kv_cache_utils.py`` (pages; "GPU KV cache size", blocks x block size; "Maximum concurrency", blocks
over a request's whole pages at ``--max-model-len``, ``get_max_concurrency_for_kv_cache_config``) and the batch
defaults of ``vllm/engine/arg_utils.py`` (``get_batch_defaults``). Flags are vLLM's, so a launch command's are copied
as they are.

Memory, per card: ``--gpu-memory-utilization`` of the card's total is the budget; from it come the weights (each
card's share at ``--tensor-parallel-size``), the profile run's activation peak and what lies outside torch's
allocator (the CUDA context's growth, cuBLAS and NCCL buffers); the rest is the KV cache, in pages of ``--block-size``
tokens of every layer, in ``--kv-cache-dtype``. CUDA graphs are captured after the cache is allocated, outside the
budget, in this version: they are not taken from it. The profile run is a forward of ``--max-num-batched-tokens``
tokens and then the sampler over ``--max-num-seqs`` requests' logits; its peak is the larger of the two. The
sampler's (float32 logits, their sort, softmax and top-p / top-k temporaries) is ``SAMPLER_BYTES`` per logit, fitted
on one published start-up log; the forward's is the widest activations of one block at that many tokens.

Speed, in steady state at a concurrency (``-b``): every request is on average half-way through its generation, so a
decode step reads the cache written so far (``--prompt-len`` + half ``--gen-len`` tokens a request: a paged cache
reads only the pages written), and the prompts of the requests that replace the finished ones are prefilled in
chunks inside the same steps (chunked prefill: ``prompt / gen`` prefill tokens a decode token). A concurrency beyond
what the cache holds runs at what it holds (the rest wait). Each quantized layer runs the engine's kernel for its
format (``kernels.VLLM_KERNELS``). At tensor parallel N each card runs 1/N of every matmul and attention and two
all-reduces a layer of the step's tokens' hidden states, at the card's interconnect (``core.machine.devices``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtypelab.core.machine.speed import Op
from dtypelab.core.results import TargetDevice

VLLM_VERSION = "vLLM v0.11 (V1 engine)"
GIB = 2**30
# bytes per logit of the sampler's profile run (max_num_seqs x vocab): Llama-3.1-8B's logged 4.76 GiB over 1024 x
# 128,256 (llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md, H100, vLLM V1); the other
# logs there are the check (docs/validation.md, family kv-capacity)
SAMPLER_BYTES = 38.9
# what lies outside torch's allocator after the profile run, by tensor parallel size: 0.13 GiB on one card (the
# same log's; 0.13-0.14 on every single-card log there), 0.55 GiB with NCCL's buffers at two (its Llama-3.3-70B TP=2
# log); larger sizes take two's, unchecked
NON_TORCH_GIB = {1: 0.13, 2: 0.55}
# one all-reduce of a decode step's hidden states (tens of KiB) under CUDA graphs on NVLink: about 6 µs
# (NVIDIA/nccl#1259: 2 x H100, NVLS, graphs); a PCIe link takes the same, unchecked
ALL_REDUCE_S = 6e-6
KV_DTYPES = {"auto": None, "bfloat16": "kv-bf16", "float16": "kv-fp16", "fp8": "kv-fp8", "fp8_e4m3": "kv-fp8",
             "fp8_e5m2": "kv-fp8-e5m2"}
STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the concurrencies a format's curve is read at


@dataclass(frozen=True)
class Engine:
    """The serving program forecast: ``static`` (one batch in lockstep over a static cache, gpt-fast's and
    torchao's harness) or ``vllm`` with its settings resolved (``resolve``)."""

    name: str = "static"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0
    tensor_parallel_size: int = 1

    @property
    def paged(self) -> bool:
        return self.name == "vllm"

    def settings(self) -> dict[str, Any]:
        """What the record keeps: the flags as vLLM spells them."""
        if not self.paged:
            return {}
        return {"gpu-memory-utilization": self.gpu_memory_utilization,
                "max-num-batched-tokens": self.max_num_batched_tokens, "max-num-seqs": self.max_num_seqs,
                "block-size": self.block_size, "kv-cache-dtype": self.kv_cache_dtype,
                "max-model-len": self.max_model_len, "tensor-parallel-size": self.tensor_parallel_size}


def resolve(engine: Engine, target: TargetDevice, context: int) -> Engine:
    """vLLM's defaults where a flag was not given: ``vllm serve``'s batch defaults (a card of at least 70 GiB that is
    not an A100: 8192 batched tokens and 1024 sequences; else 2048 and 256), the model's context as
    ``--max-model-len``; never more sequences than batched tokens."""
    if not engine.paged:
        return engine
    big = (target.memory_bytes or 0) >= 70 * GIB and "a100" not in (target.label or target.name).lower()
    tokens = engine.max_num_batched_tokens or (8192 if big else 2048)
    seqs = min(engine.max_num_seqs or (1024 if big else 256), tokens)
    return replace(engine, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                   max_model_len=engine.max_model_len or context)


@dataclass(frozen=True)
class EngineMemory:
    """One card's budget as vLLM splits it (bytes), and what its KV cache holds."""

    requested: int
    weights: int
    activation: int
    non_torch: int
    kv_pool: int  # the budget less the rest (negative: the weights and activations do not leave room)
    page_bytes: int  # one block of ``block_size`` tokens, every layer
    blocks: int
    tokens: int  # "GPU KV cache size: N tokens"
    concurrency: float  # "Maximum concurrency for L tokens per request: Cx"
    why: str = ""  # why vLLM would not start ("" when it would)


def activation_peak(config: Any, engine: Engine) -> int:
    """The profile run's peak over the weights: the sampler's logits and temporaries, or a block's widest
    activations at ``--max-num-batched-tokens`` tokens (split over the cards), whichever is larger."""
    from dtypelab.serving.kv import text_config

    text = text_config(config)
    sampler = SAMPLER_BYTES * engine.max_num_seqs * int(text.vocab_size)
    hidden, inner = int(text.hidden_size), int(getattr(text, "intermediate_size", 0) or 4 * text.hidden_size)
    # the gate and up projections' output, the activation's, and the hidden states in and out: bfloat16
    forward = engine.max_num_batched_tokens * 2 * (3 * inner / engine.tensor_parallel_size + 2 * hidden)
    return int(max(sampler, forward))


def engine_memory(config: Any, weights_bytes: int, kv_element_bytes: float, engine: Engine,
                  total_bytes: int) -> EngineMemory:
    """One card's memory as vLLM accounts it, and the KV cache's pages, tokens and concurrency."""
    from dtypelab.serving.kv import attention_layers, geometry

    tp = engine.tensor_parallel_size
    requested = int(total_bytes * engine.gpu_memory_utilization)
    weights = math.ceil(weights_bytes / tp)
    activation = activation_peak(config, engine)
    non_torch = int(NON_TORCH_GIB.get(tp, NON_TORCH_GIB[2]) * GIB)
    pool = requested - weights - activation - non_torch
    kv_heads, head_dim = geometry(config)
    page = int(engine.block_size * 2 * math.ceil(kv_heads / tp) * head_dim * kv_element_bytes
               * attention_layers(config))
    blocks = max(pool, 0) // page
    tokens = blocks * engine.block_size
    per_request = -(-engine.max_model_len // engine.block_size)  # whole pages of one request of --max-model-len
    why = ""
    if pool <= 0:
        why = ("no available memory for the cache blocks: the weights and the profile run take more than "
               f"--gpu-memory-utilization {engine.gpu_memory_utilization:g} of the card")
    elif blocks < per_request:
        why = (f"the model's max seq len ({engine.max_model_len:,}) is larger than the KV cache holds "
               f"({tokens:,} tokens): lower --max-model-len or raise --gpu-memory-utilization")
    return EngineMemory(requested, weights, activation, non_torch, pool, page, blocks, tokens,
                        blocks / per_request if per_request else 0.0, why)


def ops_at(one: tuple[Op, ...], two: tuple[Op, ...], batch: float) -> tuple[Op, ...]:
    """A decode step's ops at ``batch`` from its traces at batches 1 and 2: every count of a decode step is the
    same at every batch plus a share for each sequence (its token's FLOPs, activations and cache), so the line
    through the two gives it."""
    if len(one) != len(two):
        raise ValueError("the decode traces at batches 1 and 2 differ in their ops")

    def lin(a: float, b: float) -> float:
        return max(a + (batch - 1) * (b - a), 0.0)

    def pairs(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return tuple((k, round(lin(x, y))) for (k, x), (_, y) in zip(a, b, strict=True))

    return tuple(replace(a, flops=lin(a.flops, b.flops), work=lin(a.work, b.work), reads=pairs(a.reads, b.reads),
                         writes=pairs(a.writes, b.writes)) for a, b in zip(one, two, strict=True))


def split(ops: tuple[Op, ...], tp: int) -> tuple[Op, ...]:
    """One card's share of a step's ops at tensor parallel ``tp``: every op's FLOPs and bytes over ``tp`` (the
    norms and residual adds every card repeats are small beside the matmuls and attention)."""
    if tp == 1:
        return ops

    def part(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return tuple((k, math.ceil(b / tp)) for k, b in pairs)

    return tuple(replace(op, flops=op.flops / tp, work=op.work / tp, reads=part(op.reads), writes=part(op.writes))
                 for op in ops)


def all_reduce_s(tokens: float, hidden: int, layers: int, tp: int, link_gbs: float | None) -> float:
    """A step's all-reduces at tensor parallel ``tp``: two a layer (after attention and after the MLP) of the
    step's tokens' bfloat16 hidden states, a ring's 2(N-1)/N of them over the link each way."""
    if tp == 1:
        return 0.0
    if not link_gbs:
        raise ValueError("no interconnect bandwidth for this card")
    moved = 2 * (tp - 1) / tp * tokens * hidden * 2
    return 2 * layers * (ALL_REDUCE_S + moved / (link_gbs * 1e9))


@dataclass(frozen=True)
class Point:
    """A steady state at one concurrency: the requests running (at most what the cache holds), a step's seconds
    (its decode and its share of the prefill), and the step's seconds by what bounds them."""

    concurrency: int
    running: int
    step_s: float
    bounds: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.running / self.step_s


Timer = Callable[[tuple[Op, ...]], tuple[float, dict[str, float]]]


@dataclass(frozen=True)
class Steady:
    """What a policy's steady state is made of: its decode traces at batches 1 and 2 (at the mean context), the
    time of one prompt token in a prefill, and the settings."""

    one: tuple[Op, ...]
    two: tuple[Op, ...]
    prefill_token_s: float
    prefill_bounds: dict[str, float]
    prompt_len: int
    gen_len: int
    hidden: int
    layers: int
    engine: Engine
    link_gbs: float | None
    capacity: int  # the requests the cache holds at their mean context (0: none)

    def at(self, concurrency: int, timer: Timer) -> Point:
        """The steady state at ``concurrency`` requests."""
        running = max(min(concurrency, self.capacity, self.engine.max_num_seqs), 1)
        tp = self.engine.tensor_parallel_size
        decode_s, bounds = timer(split(ops_at(self.one, self.two, running), tp))
        prefill = running * self.prompt_len / self.gen_len  # prompt tokens a step, replacing finished requests
        prefill_s = prefill * self.prefill_token_s / tp
        talk = all_reduce_s(running + prefill, self.hidden, self.layers, tp, self.link_gbs)
        out = dict(bounds)
        for k, v in self.prefill_bounds.items():
            out[k] = out.get(k, 0.0) + prefill * v / tp
        out["overhead"] = out.get("overhead", 0.0) + talk
        return Point(concurrency, running, decode_s + prefill_s + talk, out)

    def ttft_s(self, point: Point) -> float:
        """A new request's first token under that load: its prompt in chunks of what the step's budget leaves
        beside the decoding requests, a step each."""
        chunk = max(self.engine.max_num_batched_tokens - point.running, 1)
        return math.ceil(self.prompt_len / chunk) * point.step_s + self.prompt_len * self.prefill_token_s / \
            self.engine.tensor_parallel_size


def stops_paying(curve: tuple[tuple[int, float], ...], base: tuple[tuple[int, float], ...],
                 higher_is_better: bool = True, error: float = 0.0) -> int | None:
    """The least concurrency from which a format no longer beats the baseline (at every concurrency read from there
    on its value is no better, or within the forecast's error of the baseline's: a tie, ``core.bands.overlaps``, the
    rule every forecast comparison uses); None when it beats it at every one read; 1 when it never does."""
    from dtypelab.core.bands import overlaps

    theirs = dict(base)

    def beats(mine: float, other: float) -> bool:
        return (mine > other if higher_is_better else mine < other) and not overlaps(mine, other, error)

    wins = [(c, beats(v, theirs[c])) for c, v in curve if c in theirs]
    if not wins:
        return None
    for i, (c, _) in enumerate(wins):
        if not any(w for _, w in wins[i:]):
            return c
    return None


__all__ = [
    "ALL_REDUCE_S",
    "KV_DTYPES",
    "NON_TORCH_GIB",
    "SAMPLER_BYTES",
    "STEPS",
    "VLLM_VERSION",
    "Engine",
    "EngineMemory",
    "Point",
    "Steady",
    "activation_peak",
    "all_reduce_s",
    "engine_memory",
    "ops_at",
    "resolve",
    "split",
    "stops_paying",
]
