"""The ledger: every tensor storage alive while a step runs, by what it holds, and the peak with its breakdown.

A ``TorchDispatchMode`` (torch's ``MemTracker`` is the model: ``torch.distributed._tools.mem_tracker``) that sees
every op's outputs, under ``FakeTensorMode`` (the forecast: nothing is allocated) or on real tensors (``--check``:
the same count on this machine). Each storage is counted once, from its creation to its release, in one category:
``parameters`` and ``buffers`` (the model's), ``gradients`` (as each parameter's gradient is accumulated),
``optimizer_state`` and ``master_weights`` (as the optimizer step leaves them), ``activations`` (what autograd saves
for the backward), ``loss`` (a language model's logits and what is as wide: ``loss_width``) and ``temporaries``
(everything else: the batch, outputs, the backward's and the optimizer's intermediates). ``round_to``: the
allocator's granularity (CUDA's caching allocator rounds every block up to 512 bytes, which
``torch.cuda.max_memory_allocated`` counts; 1 on the CPU).

Unlike MemTracker it keeps counting across iterations (the peak is in the second step, once the optimizer's state
exists), names master weights (a kind's ``master_tensors``), and says where the peak came: the phase of the step and
the innermost module running (``torch.utils.module_tracker``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from dtypelab.core.footprint import as_wide, leaves
from dtypelab.core.policies.checkpointing import recomputing
from dtypelab.core.results import PEAK_CATEGORIES
from dtypelab.forecasting.ops import RECORDED, record

CATEGORIES = PEAK_CATEGORIES
_DEVICE = torch.ops.prim.device.default
CUDA_BLOCK = 512  # c10's CUDACachingAllocator rounds each allocation up to a multiple of this (kMinBlockSize)


@dataclass
class Peak:
    """The most bytes alive at once, what they held, and when."""

    total: int = 0
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    phase: str = ""  # "forward", "backward", "optimizer", ...
    module: str = ""  # the innermost module running (or whose backward was), "" outside any


def _named(tracked: str) -> str:
    """A module as ``named_modules`` names it: ModuleTracker prefixes the root's class (``GPT.blocks.0``), and a
    compiled model's modules sit under ``_orig_mod``."""
    name = tracked.partition(".")[2]
    return name.removeprefix("_orig_mod.").removeprefix("_orig_mod") or "the whole model"


def _prefix_ends(name: str) -> Iterator[int]:
    """Where each dotted prefix of ``name`` ends, itself last."""
    yield from (i for i, c in enumerate(name) if c == ".")
    yield len(name)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    for leaf in leaves(t):
        if isinstance(leaf, torch.Tensor):
            yield leaf.untyped_storage()


class Tracker(ModuleTracker):
    """torch's ModuleTracker, blind to a checkpointed block's recomputation in the backward: its forward hooks would
    hang gradient hooks on the recomputed tensors, and the tracker keeps every hook's handle while it is open, so each
    step's recomputed activations would stay alive into the next (a run without the tracker frees them at once)."""

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        if not recomputing():
            super()._fw_pre_hook(mod, input)

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        if not recomputing():
            super()._fw_post_hook(mod, input, output)


class Ledger(TorchDispatchMode):
    """Counts live storages by category while active (enter it inside the ``FakeTensorMode``, if any)."""

    def __init__(self, round_to: int = 1, ops: list[Any] | None = None, calls: bool = False) -> None:
        super().__init__()
        self.ops = ops  # each op's cost (forecasting.ops.record) in a step's phases, when a list is given
        self.calls = calls  # and each heavy op's call, to time it here (a forecast for this CPU)
        self.round_to = max(1, round_to)
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [weakref, bytes, category]
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = Peak()
        self.phases: dict[str, Peak] = {}  # each phase's own peak
        self.most = dict.fromkeys(CATEGORIES, 0)  # the most each category held at any one time
        self.phase = ""
        self.default = "temporaries"  # the category of a storage an op creates
        self.loss_width = 0  # a language model's vocabulary: what is as wide is the loss's (0: no loss counted apart)
        self._modules = Tracker()
        # a stack's repeated blocks (name -> index, as the tracker names them): when given, each pass's peak is also
        # kept by where in the stack it fell (``moments``), which a deep stack's line is read from (forecasting.depth)
        self.blocks: dict[str, int] = {}
        self.moments: dict[str, Peak] = {}
        self._started: dict[str, list[int]] = {}  # each phase's blocks, in the order they started running
        self._tracked: dict[str, int | None] = {}
        # a number per storage for the ops' reads and writes: an id is reused once its storage is freed (the fusion
        # of a compiled step would then join two storages), a serial is not
        self._serials: dict[int, tuple[Any, int]] = {}
        self._next_serial = 0

    def serial(self, st: torch.UntypedStorage) -> int:
        """The storage's own number in this ledger (kept while it lives)."""
        key = id(st)
        entry = self._serials.get(key)
        if entry is not None and entry[0]() is st:
            return entry[1]
        self._next_serial += 1
        try:
            ref = weakref.ref(st, lambda _, key=key: self._serials.pop(key, None))
        except TypeError:  # no weak reference: never matched again, so never joined to another
            return -self._next_serial
        self._serials[key] = (ref, self._next_serial)
        return self._next_serial

    # --- counting ---------------------------------------------------------------------------------
    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        return -(-n // self.round_to) * self.round_to if n else 0

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current[entry[2]] -= entry[1]
            self.total -= entry[1]

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = id(st)
        if key in self._live:
            return
        size = self._bytes(st)
        try:
            ref = weakref.ref(st, lambda _, key=key: self._forget(key))
        except TypeError:  # a storage that takes no weak reference cannot be followed to its release
            return
        self._live[key] = [ref, size, category]
        self.current[category] += size
        self.total += size

    def claim(self, tensors: Iterable[Any], category: str, only_from: tuple[str, ...] | None = None) -> int:
        """Count the storages of ``tensors`` in ``category`` from now on (adding those not yet counted); with
        ``only_from``, move only storages now in those categories (an activation that is also a parameter stays a
        parameter). Returns the bytes moved or added."""
        moved = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                entry = self._live.get(id(st))
                if entry is None:
                    self._add(st, category)
                    moved += self._live[id(st)][1] if id(st) in self._live else 0
                elif entry[2] != category and (only_from is None or entry[2] in only_from):
                    self.current[entry[2]] -= entry[1]
                    self.current[category] += entry[1]
                    entry[2] = category
                    moved += entry[1]
        self._update_peak()
        return moved

    def _update_peak(self) -> None:
        for category, held in self.current.items():
            if held > self.most[category]:
                self.most[category] = held
        phase = self.phases.get(self.phase)
        new_phase = bool(self.phase) and (phase is None or self.total > phase.total)  # "": between phases
        moments = [m for m in (self._moments_now() if self.blocks else ())
                   if m not in self.moments or self.total > self.moments[m].total]
        if not (self.total > self.peak.total or new_phase or moments):
            return
        now = Peak(self.total, dict(self.current), self.phase, self._innermost())
        if new_phase:
            self.phases[self.phase] = now
        for moment in moments:
            self.moments[moment] = now
        if self.total > self.peak.total:
            self.peak = now

    def _innermost(self) -> str:
        """The deepest module running, in a forward or backward ("" otherwise): names nest (blocks, blocks.0,
        blocks.0.mlp), so the longest."""
        if self.phase not in ("forward", "backward"):
            return ""
        parents = [p for p in self._modules.parents if p != "Global"]
        return _named(max(parents, key=len)) if parents else ""

    def _moments_now(self) -> tuple[str, ...]:
        """``phase@where`` in a pass: before any block ran, or in the block that ran last, at the stack's low end (its
        first two blocks) or its high end (its last two); none between them, nor outside a pass (a phase's own peak
        says it). A block between two others is like every such block and its bytes are linear in its index, so none
        between peaks above both ends; the first block (its input needs no gradient) and the last (beside the head)
        differ from their neighbours by what no depth changes. The block running is the one whose name joined the
        running modules last: the tracker can keep a module it saw in a backward among them after that backward
        ended."""
        if self.phase not in ("forward", "backward"):
            return ()
        started = self._started.setdefault(self.phase, [])
        for parent in self._modules.parents:
            index = self._block_of(parent)
            if index is not None and index not in started:
                started.append(index)
        if not started:
            return (f"{self.phase}@before",)
        index, depth = started[-1], len(self.blocks)
        ends = (*(("low",) if index <= 1 else ()), *(("high",) if index >= depth - 2 else ()))
        return tuple(f"{self.phase}@{end}" for end in ends)

    def _block_of(self, tracked: str) -> int | None:
        """The index of the block a module (as the tracker names it) is or sits in (None: none)."""
        if tracked not in self._tracked:
            name = _named(tracked)
            self._tracked[tracked] = next((self.blocks[name[:end]] for end in _prefix_ends(name)
                                           if name[:end] in self.blocks), None)
        return self._tracked[tracked]

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._live.get(id(st))
        if entry is not None:
            size = self._bytes(st)
            self.current[entry[2]] += size - entry[1]
            self.total += size - entry[1]
            entry[1] = size
            self._update_peak()

    # --- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE:  # a query, not an op (autograd asks a fake tensor's device thousands of times a step)
            device = getattr(args[0], "fake_device", None)
            return device if device is not None else func(*args, **(kwargs or {}))
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # DTensor runs its local ops first; those are what allocate
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                category = self._category(t)
                for st in _storages(t):
                    self._add(st, category)
        self._update_peak()
        if self.ops is not None and self.phase in RECORDED:
            op = record(func, args, kwargs or {}, out, self.phase, self.serial, self.calls)
            if op is not None:
                parents = [p for p in self._modules.parents if p != "Global"]
                self.ops.append(replace(op, module=_named(max(parents, key=len))) if parents else op)
        return out

    def _category(self, t: torch.Tensor) -> str:
        """A new storage's category: the step's default, or ``loss`` for a tensor as wide as the logits (``loss_width``)
        made where a temporary would be (the logits, their float32 copy, the log-probabilities, their gradients)."""
        if self.default == "temporaries" and as_wide(t, self.loss_width):
            return "loss"
        return self.default

    def __enter__(self) -> Ledger:
        # FSDP2 frees and re-allocates its unsharded parameters with UntypedStorage.resize_, which no dispatch mode
        # sees: followed while the ledger is open (as torch's MemTracker does), restored on exit
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._modules.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
            self._modules.__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]

    # --- what the step tells it -----------------------------------------------------------------------
    @contextmanager
    def phase_of(self, name: str, default: str = "temporaries") -> Iterator[None]:
        """Inside the block, the step is in phase ``name`` and new storages go to ``default``."""
        saved = self.phase, self.default
        self.phase, self.default = name, default
        try:
            yield
        finally:
            self.phase, self.default = saved

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """A ``saved_tensors_hooks`` pack hook: what autograd saves for the backward is an activation (unless it is
        a parameter or buffer, saved by reference)."""
        self.claim([t], "activations", only_from=("temporaries",))
        return t

    def held_by(self, obj: Any) -> dict[str, int]:
        """The counted storages among the tensors in ``obj`` (nested), each once, by their category now."""
        seen: set[int] = set()
        out: dict[str, int] = {}
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    entry = self._live.get(id(st))
                    if entry is not None and id(st) not in seen:
                        seen.add(id(st))
                        out[entry[2]] = out.get(entry[2], 0) + entry[1]
        return out
