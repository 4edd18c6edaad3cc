"""Per-layer fidelity (the Numeric Suite idea, for any model): the SQNR of every leaf layer's output in
the converted model against the fp32 model on the same inputs.

Two numbers per layer: ``sqnr_db`` compares the layer's output when each model runs end to end (errors
accumulated from every layer before it); ``own_sqnr_db`` feeds the converted layer the fp32 model's own
input for that layer, so it is that layer's error alone — the one that says which layers to keep wide.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from dtypelab.core.policies import Precision
from dtypelab.core.results import PER_LAYER_SAMPLES
from dtypelab.core.task import Batch, call_model, map_tensors, tensors
from dtypelab.inference.fidelity import flat, sqnr_db

SAMPLES = PER_LAYER_SAMPLES  # per-layer outputs are held in memory: a slice of the inference batch is enough
_SKIP = (nn.Dropout, nn.Identity)


def _first_float(out: Any) -> torch.Tensor | None:
    """The first floating tensor of a layer's output (a tensor, or a tuple/dict holding one)."""
    return next((t for t in tensors(out) if t.is_floating_point()), None)


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n and not any(True for _ in m.children())
            and not isinstance(m, _SKIP)}


def layer_fidelity(reference: nn.Module, converted: nn.Module, inputs: Batch, policy: Precision) -> list[dict]:
    """One row per leaf layer present in both models, in module order: layer, type, sqnr_db, own_sqnr_db."""
    converted = getattr(converted, "_orig_mod", converted)  # torch.compile'd: its eager graph, same weights
    # Leaves of the fp32 model; the converted module of the same name may not be a leaf (torch.ao's
    # quantized Linear holds its packed weight in a child module).
    ref_leaves = _leaves(reference)
    conv_leaves = {n: m for n, m in converted.named_modules() if n in ref_leaves}
    names = [n for n in ref_leaves if n in conv_leaves]
    inputs = map_tensors(lambda t: t[:SAMPLES], inputs)
    conv_out: dict[str, list[torch.Tensor]] = defaultdict(list)
    rows: list[dict] = []
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = defaultdict(list)

    def keep_converted(name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            t = _first_float(out)
            if t is not None:
                conv_out[name].append(t.detach().float())
        return hook

    def compare_reference(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            ref = _first_float(out)
            calls = conv_out.get(name, [])
            index = len(pairs[name])
            if ref is None or index >= len(calls):
                return
            with torch.no_grad(), policy.forward_context():  # the converted layer alone, on fp32's input
                own = _first_float(conv_leaves[name](*policy.convert_input(args), **policy.convert_input(kwargs)))
            pairs[name].append((ref.detach().float(), calls[index], None if own is None else own.detach().float()))
        return hook

    handles = [conv_leaves[n].register_forward_hook(keep_converted(n)) for n in names]
    try:
        with torch.no_grad(), policy.forward_context():
            call_model(converted, policy.convert_input(inputs))
    finally:
        for h in handles:
            h.remove()
    handles = [ref_leaves[n].register_forward_hook(compare_reference(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            call_model(reference, inputs)
    finally:
        for h in handles:
            h.remove()
    for name in names:
        calls = pairs.get(name)
        if not calls:
            continue
        ref = flat([c[0] for c in calls])
        acc = flat([c[1] for c in calls])
        own = flat([c[2] for c in calls]) if all(c[2] is not None for c in calls) else None
        rows.append({
            "layer": name, "type": type(conv_leaves[name]).__name__,
            "sqnr_db": sqnr_db(ref, acc) if acc.shape == ref.shape else None,
            "own_sqnr_db": sqnr_db(ref, own) if own is not None and own.shape == ref.shape else None,
        })
    return rows
