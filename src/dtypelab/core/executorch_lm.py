"""A causal language model as an ExecuTorch program that holds its own key/value cache, as ExecuTorch's LLM runner
runs one: transformers' static-cache export recipe (``TorchExportableModuleWithStaticCache``: the cache as the
program's mutable buffers, ``forward(input_ids, cache_position)`` with the sequence dimension dynamic), quantized
and lowered to XNNPACK as ``core.executorch`` does a whole model. ``PteLM`` runs it with transformers' call
(``input_ids``, ``past_key_values``, ``use_cache``, ``logits_to_keep``), so serving prefills, decodes and scores it as
it does any model; ``ProgramCache`` is where the program's cache stands.

The program's shapes are fixed when it is exported, as a device app's are: its batch (a call with fewer rows is
padded) and the positions its cache holds.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dtypelab.core.calibration import Feed
from dtypelab.core.errors import DtypelabError
from dtypelab.core.executorch import Exporter, Lowered, PteModule, float_dtype, to_program

EXAMPLE_TOKENS = 4  # the example call's length (a dynamic dimension's example must not be 0 or 1)


@dataclass(frozen=True)
class Generation:
    """What a generation program is exported for: ``batch`` sequences of up to ``max_len`` positions."""

    batch: int
    max_len: int


_GENERATION: ContextVar[Generation | None] = ContextVar("dtypelab_generation", default=None)


@contextlib.contextmanager
def generating(batch: int, max_len: int) -> Iterator[None]:
    """While open, an ExecuTorch policy converts a language model to a generation program of this shape (serving
    sets it around the conversion; without it the whole model is exported for its task's calls)."""
    token = _GENERATION.set(Generation(batch, max_len))
    try:
        yield
    finally:
        _GENERATION.reset(token)


def generation() -> Generation | None:
    return _GENERATION.get()


@dataclass(frozen=True)
class LMOutput:
    logits: torch.Tensor


def _static_cache_module(model: nn.Module, shape: Generation) -> nn.Module:
    """transformers' export recipe around ``model``: it asks the model's generation config for a static cache,
    which is set for the recipe and put back."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    config = getattr(model, "generation_config", None)
    if config is None:
        raise DtypelabError(f"{type(model).__name__} has no generation config: an ExecuTorch generation program is "
                            "exported from a transformers causal language model")
    saved = config.cache_implementation
    config.cache_implementation = "static"
    try:
        return TorchExportableModuleWithStaticCache(model, shape.batch, shape.max_len,  # type: ignore[arg-type]
                                                    torch.device("cpu"))
    finally:
        config.cache_implementation = saved


def _calibrate(feed: Feed | None, shape: Generation) -> Any:
    """Runs the calibration windows through a prepared program-to-be, ``shape.batch`` rows from position 0 at a
    time (the feed calls with a few windows; each is cut to the cache's length)."""
    def calibrate(prepared: nn.Module) -> None:
        if feed is None:
            raise DtypelabError("et-int8 calibrates its activations on text, and none was given (bench and tune "
                                "--mode generate give calibration windows)")

        def run(ids: torch.Tensor) -> None:
            ids = ids[:, :shape.max_len - 1]
            for i in range(0, len(ids), shape.batch):
                prepared(input_ids=_rows(ids[i:i + shape.batch], shape.batch),
                         cache_position=torch.arange(ids.shape[1]))

        feed(_Caller(run))
    return calibrate


class _Caller(nn.Module):
    """A feed's model: the token ids of its calls go to ``run``."""

    def __init__(self, run: Any) -> None:
        super().__init__()
        self.run = run

    def forward(self, *args: Any, **kwargs: Any) -> None:
        self.run(kwargs["input_ids"] if "input_ids" in kwargs else args[0])


def generates(model: nn.Module) -> bool:
    """A transformers model that generates through a key/value cache: exported as a generation program, whatever
    calls it (its eager outputs carry the cache, which a program cannot return)."""
    can = getattr(model, "can_generate", None)
    return bool(callable(can) and can() and getattr(getattr(model, "config", None), "use_cache", False))


def shape_of(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Generation:
    """The generation program that serves a task's calls of a language model: their batch, their longest length."""
    ids = [k["input_ids"] if "input_ids" in k else a[0] for a, k in calls]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in ids):
        raise DtypelabError("an ExecuTorch language model program takes token ids (batch x tokens) as its calls")
    return Generation(int(ids[0].shape[0]), max(int(t.shape[1]) for t in ids) + 1)


def _rows(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``ids`` padded to ``batch`` rows with its last (the padding's outputs are dropped)."""
    if len(ids) > batch:
        raise DtypelabError(f"the ExecuTorch program was exported for {batch} sequences at once, not {len(ids)}")
    if len(ids) < batch:
        ids = torch.cat([ids, ids[-1:].expand(batch - len(ids), ids.shape[1])])
    return ids.contiguous()


def lower_lm(model: nn.Module, scheme: str, shape: Generation, feed: Feed | None) -> Lowered:
    """``model`` as a generation program of ``shape`` under ``scheme``: its cache inside, the tokens' count
    dynamic up to the cache's length less one."""
    if shape.max_len < EXAMPLE_TOKENS + 1:
        raise DtypelabError(f"an ExecuTorch generation program needs more than {EXAMPLE_TOKENS} positions")
    dtype = float_dtype(scheme)
    wrapped = _static_cache_module(model.to(dtype).eval().requires_grad_(False), shape)
    seq = torch.export.Dim("tokens", min=1, max=shape.max_len - 1)
    export = Exporter((), {"input_ids": torch.zeros((shape.batch, EXAMPLE_TOKENS), dtype=torch.long),
                           "cache_position": torch.arange(EXAMPLE_TOKENS)},
                      {"input_ids": {1: seq}, "cache_position": {0: seq}}, strict=True)
    p = to_program(wrapped, scheme, export, _calibrate(feed, shape), llm=True)
    return Lowered(p.buffer, pytree.treespec_dumps(p.ep.call_spec.in_spec),
                   pytree.treespec_dumps(p.ep.call_spec.out_spec), shape.batch, str(dtype).split(".")[-1],
                   p.delegated, p.fallback, p.planned_bytes, shape.max_len, p.state_bytes)


class ProgramCache:
    """Where a generation program's cache stands: the positions filled. The keys and values live in the program
    (one cache per program: a new one starts it over at position 0, whose stale entries its mask hides)."""

    def __init__(self, program: PteLM, batch: int) -> None:
        self.program, self.batch, self.position = program, batch, 0

    def reset(self) -> None:
        self.position = 0

    @property
    def nbytes(self) -> int:
        return self.program.lowered.cache_bytes


class PteLM(PteModule):
    """A generation program run by ExecuTorch's runtime with transformers' call: ``input_ids`` continue the cache
    given as ``past_key_values`` (a ``ProgramCache`` of this program; none: each ``batch`` rows from position 0);
    the logits come back in float32, ``logits_to_keep`` of them (0: every position's). No parameters: its weights
    live in the program."""

    def __init__(self, lowered: Lowered) -> None:
        if not lowered.max_len:
            raise DtypelabError("the .pte is not a generation program (it has no key/value cache)")
        super().__init__(lowered)
        self.dtype: torch.dtype = getattr(torch, lowered.float_dtype)
        self._current: ProgramCache | None = None

    def new_cache(self, batch: int, length: int) -> ProgramCache:
        """A cache for ``batch`` sequences of ``length`` positions: the program's, started over."""
        if batch > self.lowered.batch or length > self.lowered.max_len:
            raise DtypelabError(f"the ExecuTorch program was exported for {self.lowered.batch} sequences of "
                                f"{self.lowered.max_len} positions, not {batch} of {length}")
        self._current = ProgramCache(self, batch)
        return self._current

    def forward(self, input_ids: torch.Tensor, past_key_values: ProgramCache | None = None, use_cache: bool = True,
                logits_to_keep: int = 0, **unused: Any) -> LMOutput:
        given = sorted(k for k, v in unused.items() if v is not None)
        if given:
            raise DtypelabError(f"an ExecuTorch generation program takes input_ids and its cache, not {given}")
        if past_key_values is None:  # calls without a cache (a task's): each batch of rows from position 0
            batch = self.lowered.batch
            return LMOutput(torch.cat([self.forward(input_ids[i:i + batch], self.new_cache(
                len(input_ids[i:i + batch]), input_ids.shape[1]), use_cache, logits_to_keep).logits
                for i in range(0, len(input_ids), batch)]))
        cache = past_key_values
        if cache is not self._current:
            raise DtypelabError("an ExecuTorch program holds one cache: this one was started over by a newer one")
        start, n = cache.position, input_ids.shape[1]
        if start + n > self.lowered.max_len:
            raise DtypelabError(f"the ExecuTorch program's cache holds {self.lowered.max_len} positions: "
                                f"{start} + {n} tokens do not fit")
        leaves, spec = pytree.tree_flatten(((), {"input_ids": _rows(input_ids.cpu(), self.lowered.batch),
                                                 "cache_position": torch.arange(start, start + n)}))
        if spec != self._in_spec:
            raise DtypelabError(f"the .pte was exported for calls shaped {self._in_spec}, not {spec}")
        logits = self._method.execute(leaves)[0][:len(input_ids)].float()
        cache.position = start + n if use_cache else start
        return LMOutput(logits[:, -logits_to_keep:] if logits_to_keep else logits)


def write_program(lowered: Lowered, path: str) -> None:
    """The program at ``path`` and what calling it needs beside it (``path``.json): for another process of this run
    to load the very program measured here."""
    with open(path, "wb") as f:
        f.write(lowered.program)
    with open(path + ".json", "w") as f:
        json.dump(lowered.metadata(), f)


def read_program(path: str) -> Lowered:
    """What ``write_program`` wrote (the JSON read as data: nothing in either file runs)."""
    with open(path, "rb") as f:
        program = f.read()
    with open(path + ".json") as f:
        return Lowered.from_metadata(program, json.load(f))


def program_module(lowered: Lowered) -> PteModule:
    """The program as a module: a generation program's (it holds a cache) takes transformers' call."""
    return PteLM(lowered) if lowered.max_len else PteModule(lowered)


__all__ = ["Generation", "LMOutput", "ProgramCache", "PteLM", "generates", "generating", "generation", "lower_lm",
           "program_module", "read_program", "shape_of", "write_program"]
