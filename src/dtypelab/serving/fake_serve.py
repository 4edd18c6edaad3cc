"""The serving workload on fake tensors: the model built on the meta device and converted by each policy (on a GPU
target its weights in bfloat16 first; a format whose conversion needs a GPU traced with bfloat16 weights in its
place, its layout's bytes added), and two passes counted by forecasting's ledger: the prefill into a cache allocated
for the whole context, and one decode step with the cache full. A deep model (``forecasting.depth.read_off``, as
training's) is traced with 3 and 4 blocks and read off the line through them; a block's share of both peaks, once
known to be exactly its weights and its cache, lets a search's sizes be traced at 3 blocks only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import quiet
from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.machine.speed import Op
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import TargetDevice
from dtypelab.core.tasks.hub import at_depth
from dtypelab.forecasting import (
    CUDA_BLOCK,
    Ledger,
    along,
    eager,
    faked,
    fresh,
    layout_bytes,
    materialize,
    read_off,
    shallow_depths,
)
from dtypelab.serving.kernels import KERNEL
from dtypelab.serving.kv import KVFormat, cache_bytes, geometry, held_tokens, windows
from dtypelab.serving.policies import ServePolicy
from dtypelab.serving.served import Served, config_of
from dtypelab.serving.workload import Shape, compute_dtype, decode, new_cache, prefill

MOST_BATCH = 4096  # the largest batch searched
WEIGHTS = ("parameters", "frozen_weights")


@dataclass(frozen=True)
class Pass:
    """One traced pass: its peak and what held it, and its ops."""

    peak: int
    weights: int
    kv: int
    ops: tuple[Op, ...]

    def line(self, other: Pass, k: int) -> Pass:
        """This pass and ``other`` (one period of blocks deeper) read ``k`` periods deeper than this one."""

        def lin(a: int, b: int) -> int:
            return round(along(a, b, k))

        return Pass(lin(self.peak, other.peak), lin(self.weights, other.weights), lin(self.kv, other.kv),
                    self.ops + tuple(op for _ in range(k) for op in _block_ops(self.ops, other.ops)))


def _block_ops(one: tuple[Op, ...], two: tuple[Op, ...]) -> tuple[Op, ...]:
    """The ops one more period of blocks adds: the deeper trace's ops beyond the shallower's count, from the first
    block that differs (a period's ops are alike; what follows the stack, the head, is in both)."""
    extra = len(two) - len(one)
    first = next((i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a.module != b.module), len(one))
    return two[first:first + extra]


@dataclass
class Traced:
    prefill: Pass
    decode: Pass
    dtype: Any = None  # the compute dtype the model handed its cache

    @property
    def peak(self) -> int:
        return max(self.prefill.peak, self.decode.peak)


class ServeForecaster:
    """One model's serving forecasts: its meta model built once per depth, each policy's converted once per depth."""

    def __init__(self, served: Served, target: TargetDevice, seed: int) -> None:
        self.served, self.target, self.seed = served, target, seed
        self._meta: nn.Module | None = None
        self.config = served.config if served.config is not None else config_of(self.meta)
        self.layers = int(self.config.num_hidden_layers)
        self.shallow = shallow_depths(windows(self.config), self.layers)
        self.deep = read_off(self.layers, self.shallow)
        self.cuda = target.kind == "cuda"
        self._metas: dict[int, tuple[nn.Module, Any]] = {}
        self._converted: dict[tuple[str, int], tuple[nn.Module, int, dict[str, str]]] = {}
        # the compute dtype each plan's model hands its cache, per depth (found by its first trace)
        self.dtypes: dict[tuple[str, int], torch.dtype] = {}

    @property
    def meta(self) -> nn.Module:
        """The whole model on the meta device (built when first asked: a deep one is traced at 3 and 4 blocks)."""
        if self._meta is None:
            torch.manual_seed(self.seed)
            with torch.device("meta"):
                self._meta = self.served.make_model()
        return self._meta

    def build(self, config: Any) -> nn.Module:
        with torch.device("meta"):
            return self.build_real(config)

    def build_real(self, config: Any) -> nn.Module:
        """The model from ``config``, on the current device."""
        if self.served.config is not None:
            from transformers import AutoModelForCausalLM

            with quiet():  # the model's module, imported now, may import torchao: its import-time noise
                model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
                return model
        return type(self.meta)(config)

    def parameters(self) -> int:
        """The model's parameter count (each once), off the line through its shallow versions when it is deep."""
        if not self.deep:
            return sum(p.numel() for p in self.meta.parameters())
        one, two = (sum(p.numel() for p in self.at_depth(d)[0].parameters()) for d in self.shallow)
        return one + (two - one) * self.periods

    @property
    def periods(self) -> int:
        """The repeats of the pattern the line adds past the shallower trace."""
        return (self.layers - self.shallow[0]) // (self.shallow[1] - self.shallow[0])

    def at_depth(self, depth: int) -> tuple[nn.Module, Any]:
        if depth not in self._metas:
            if depth == self.layers:
                self._metas[depth] = (self.meta, self.config)
            else:
                config = at_depth(self.config, depth)
                self._metas[depth] = (self.build(config), config)
        return self._metas[depth]

    def converted(self, plan: Plan, depth: int) -> tuple[nn.Module, int, dict[str, str]]:
        """The converted meta model, the bytes its weights store beyond the trace's (a stand-in's layout), and each
        quantized layer's kernel key."""
        key = (plan.name, depth)
        if key not in self._converted:
            meta, _ = self.at_depth(depth)
            self._converted[key] = convert(plan, meta, self.cuda)
        model, extra, layers = self._converted[key]
        return fresh(model), extra, layers



def quantized_layers(plan: Plan, model: nn.Module) -> dict[str, str]:
    """Each layer a kind converts to a GPU kernel of its own (``kernels.KERNEL``), with its kernel key."""
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = set().union(*(c.leaves(model) for c in plan.configs))  # a weight format's output head stays bfloat16
    return {name: key for name, config in plan.assign(model).items()
            if name not in kept and (key := KERNEL(config, modules[name]))}


def convert(plan: Plan, meta: nn.Module, cuda: bool) -> tuple[nn.Module, int, dict[str, str]]:
    """The model as the policy serves it; on a GPU, weights in bfloat16 before any quantization (torchao's weight
    formats keep their activations in the weights' dtype). A conversion this machine cannot make (an int4 or fp8
    matmul's layout) leaves bfloat16 weights in its place and counts the format's bytes from its layout (the
    training forecast's ``layout_bytes``)."""
    layers = quantized_layers(plan, meta)
    try:
        if not (cuda and layers):
            return Precision(plan, "cpu", traced=True).convert_module(fresh(meta)), 0, layers
        model = fresh(meta).to(torch.bfloat16)
        for config in plan.configs:
            names = [n for n, c in plan.assign(model).items() if c == config]
            model, _ = config.convert_module(model, names)
        return model, 0, layers
    except Exception as exc:
        if not layers or not cuda:
            raise DtypelabError(f"converting the model failed: {describe_exception(exc)}") from exc
    extra = layout_bytes(plan, meta, CUDA_BLOCK)
    return fresh(meta).to(torch.bfloat16), sum(extra[name] for name in layers if name in extra), layers


def trace(model: nn.Module, config: Any, fmt: KVFormat, shape: Shape, cuda: bool, timed: bool,
          dtype: torch.dtype | None = None) -> Traced:
    """The prefill and one decode step at the full context, on fake tensors (``dtype``: the compute dtype the model
    hands its cache, when known; else found by running one token)."""
    cpu = torch.device("cpu")
    round_to = CUDA_BLOCK if cuda else 1
    with eager(), faked() as mode, torch.no_grad():
        materialize(model, mode, cpu)
        dtype = dtype or compute_dtype(model, config, cpu)
        ids = torch.zeros((shape.batch_size, shape.prompt_len), dtype=torch.long)
        with Ledger(round_to=round_to, ops=[] if timed else None, calls=not cuda) as ledger:
            ledger.claim(model.parameters(), "parameters")
            ledger.claim(model.buffers(), "parameters")
            with ledger.phase_of("cache", default="buffers"):
                cache = new_cache(config, fmt, shape, dtype, cpu)
            with ledger.phase_of("forward"):
                token = prefill(model, ids, cache)
            first = _pass(ledger, cache)
        for layer in cache.layers:
            layer.seek(shape.context - 1)
        with Ledger(round_to=round_to, ops=[] if timed else None, calls=not cuda) as ledger:
            ledger.claim(model.parameters(), "parameters")
            ledger.claim(model.buffers(), "parameters")
            ledger.claim([t for layer in cache.layers for t in layer.tensors()], "buffers")
            token = token.clone()
            with ledger.phase_of("forward"):
                decode(model, token, cache)
            return Traced(first, _pass(ledger, cache), dtype)


def _pass(ledger: Any, cache: Any) -> Pass:
    peak = ledger.phases["forward"]
    return Pass(peak.total, sum(ledger.current[k] for k in WEIGHTS), cache_bytes(cache), tuple(ledger.ops or ()))


# --- one policy ---------------------------------------------------------------------------------------------------
class PolicyRun:
    """One serving policy's traces: at the job's shape and, for the searches, at other batch sizes and contexts;
    a deep model from its traces at 3 and 4 blocks."""

    def __init__(self, fc: ServeForecaster, policy: ServePolicy, cache: dict[tuple[Any, ...], Traced]) -> None:
        self.fc, self.policy, self.cache = fc, policy, cache
        self.deep = fc.deep
        self.depths = fc.shallow if self.deep else (fc.layers,)
        self.layers: dict[str, str] = {}
        self.stand_in = False
        self.block: int | None = None  # a block's weights, once its share of the peaks is known exact (0: not)

    def traced(self, shape: Shape, timed: bool = False) -> Traced:
        """Both passes at ``shape`` (read off the line through the shallow traces for a deep model), with the
        stand-in's weights at their format's bytes. Once a block's share of both peaks is known to be its weights
        and its cache exactly (``_block``), a search's sizes are traced at 3 blocks only and the rest added. The line
        adds whole periods of the blocks' pattern (``shallow_depths``), each block at its own kind."""
        if not self.deep:
            return self._at(self.depths[0], shape, timed)
        at, k, low = self.fc.layers, self.fc.periods, self.depths[0]
        rest = range(low, at)
        if not timed and self.block:
            one = self._at(low, shape, False)
            rounded, stored = self._block_kv(shape, one.dtype, rest)
            w = self.block

            def more(p: Pass) -> Pass:
                return Pass(p.peak + k * w + rounded, p.weights + k * w, p.kv + stored, ())

            return Traced(more(one.prefill), more(one.decode), one.dtype)
        one, two = (self._at(depth, shape, timed) for depth in self.depths)
        if self.block is None:
            self.block = self._block(one, two, shape)
        return Traced(one.prefill.line(two.prefill, k), one.decode.line(two.decode, k), one.dtype)

    def _block_kv(self, shape: Shape, dtype: Any, layers: range) -> tuple[int, int]:
        """The cache of ``layers`` at ``shape``: its bytes as the allocator rounds each tensor, and as stored (a
        sliding-window layer holds its window at most)."""
        kv_heads, head_dim = geometry(self.fc.config)
        fmt = self.policy.kv
        element = fmt.element_bytes or torch.empty((), dtype=dtype).element_size()
        block = CUDA_BLOCK if self.fc.cuda else 1
        position = 8  # the layer's count of tokens written (an int64 tensor), held beside its keys and values
        held = held_tokens(self.fc.config, shape.context)
        rounded = stored = 0
        for i in layers:
            cells = shape.batch_size * kv_heads * held[i]
            sizes = [cells * head_dim * element] * 2
            scales = fmt.scale_shape(shape.batch_size, kv_heads, held[i])
            sizes += [math.prod(scales) * 4] * 2 if scales is not None else []  # float32 scales beside keys, values
            rounded += sum(-(-n // block) * block for n in (*sizes, position))
            stored += sum(sizes)
        return rounded, stored

    def _block(self, one: Traced, two: Traced, shape: Shape) -> int:
        """A block's weights, when one more block adds exactly its weights and its cache to both peaks (0: it adds
        something else too, and every size is traced at both depths)."""
        w = two.decode.weights - one.decode.weights
        rounded, stored = self._block_kv(shape, one.dtype, range(*self.depths))
        exact = all(b.peak - a.peak == w + rounded and b.kv - a.kv == stored
                    for a, b in ((one.prefill, two.prefill), (one.decode, two.decode)))
        return w if exact else 0

    def _at(self, depth: int, shape: Shape, timed: bool) -> Traced:
        model, extra, layers = self.fc.converted(self.policy.plan, depth)
        self.layers.update(layers)  # every depth's quantized layers (the line's ops name the deepest's)
        self.stand_in = bool(extra)
        # a stand-in's weights are bfloat16's: its traces are bf16's, shifted by its layout's bytes
        layout = ("bf16" if extra else self.policy.plan.name, self.policy.kv.label, depth, shape)
        if layout not in self.cache or (timed and not self.cache[layout].prefill.ops):
            _, config = self.fc.at_depth(depth)
            known = (self.policy.plan.name, depth)
            self.cache[layout] = trace(model, config, self.policy.kv, shape, self.fc.cuda, timed,
                                       self.fc.dtypes.get(known))
            self.fc.dtypes[known] = self.cache[layout].dtype
        t = self.cache[layout]
        return Traced(_shift(t.prefill, extra), _shift(t.decode, extra), t.dtype)


def _shift(p: Pass, extra: int) -> Pass:
    return Pass(p.peak + extra, p.weights + extra, p.kv, p.ops)
