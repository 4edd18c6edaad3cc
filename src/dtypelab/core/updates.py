"""Which updates round away: over sampled optimizer steps, per parameter tensor and storage format, the share of
elements whose update is too small to change the weight stored in that format (under half its spacing there), and
the median |update| / |weight|.

The update of an element is what the step did to it, ``after - before`` (exact in float64). An element counts when
the step meant to move it: its gradient was not zero, or it moved (weight decay). In a format F it is *lost* when
``F(F(before) + update) == F(before)``: stored in F, the weight would not change. For the format the run keeps its
weights in, that is exactly "the weight stayed the same though its gradient was not zero".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

UPDATE_FORMATS = ("float32", "bfloat16", "float16")  # where weights are stored in training
RATIO_SAMPLE = 4096  # |update| / |weight| values kept per parameter and step for the median


@dataclass
class _Tally:
    numel: int
    dtype: str
    steps: int = 0
    moved: int = 0  # elements the sampled steps meant to move, over all steps
    lost: dict[str, int] = field(default_factory=dict)
    ratios: list[torch.Tensor] = field(default_factory=list)


class UpdateCounter:
    """``before()`` once the gradients are there (after backward), ``after()`` once the optimizer stepped; a step
    the optimizer skipped (GradScaler found inf/NaN) is dropped with ``after(skipped=True)``."""

    def __init__(self, params: Iterable[tuple[str, nn.Parameter]],
                 formats: Iterable[str] | None = UPDATE_FORMATS) -> None:
        """``formats``: the storage formats to judge every parameter's updates in; None: each parameter's own
        dtype (what the run itself lost)."""
        self.params = [(n, p) for n, p in params if p.requires_grad and p.is_floating_point()]
        self.formats = tuple(formats) if formats is not None else None
        self.tallies = {n: _Tally(p.numel(), str(p.dtype).removeprefix("torch.")) for n, p in self.params}
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def before(self) -> None:
        self._before = {n: (p.detach().clone(), p.grad != 0 if p.grad is not None else torch.zeros_like(p, dtype=bool))
                        for n, p in self.params}

    @torch.no_grad()
    def after(self, skipped: bool = False) -> None:
        taken, self._before = self._before, {}
        if skipped or not taken:
            return
        for name, p in self.params:
            old, pushed = taken[name]
            update = p.detach().double() - old.double()
            moved = pushed | (update != 0)
            tally = self.tallies[name]
            tally.steps += 1
            tally.moved += int(moved.sum())
            for fmt in self.formats or (tally.dtype,):
                dtype = getattr(torch, fmt)
                stored = old.to(dtype)
                same = (stored.double() + update).to(dtype) == stored
                tally.lost[fmt] = tally.lost.get(fmt, 0) + int((same & moved).sum())
            ratio = (update.abs() / old.double().abs())[moved & (old != 0)].flatten()
            if ratio.numel() > RATIO_SAMPLE:  # an even sample: the median of a big tensor need not see every element
                ratio = ratio[torch.linspace(0, ratio.numel() - 1, RATIO_SAMPLE).long()]
            tally.ratios.append(ratio.float())

    def rows(self) -> list[dict]:
        """One row per parameter: ``parameter``, ``numel``, ``dtype`` (as the run stored it), ``steps`` sampled,
        ``moved`` (elements × steps meant to move), ``lost`` (share per format) and ``ratio`` (median
        |update| / |weight|; None when nothing moved)."""
        out = []
        for name, t in self.tallies.items():
            ratios = torch.cat(t.ratios) if t.ratios else torch.empty(0)
            out.append({"parameter": name, "numel": t.numel, "dtype": t.dtype, "steps": t.steps, "moved": t.moved,
                        "lost": {f: (t.lost.get(f, 0) / t.moved if t.moved else 0.0)
                                 for f in self.formats or (t.dtype,)},
                        "ratio": float(ratios.median()) if ratios.numel() else None})
        return out
