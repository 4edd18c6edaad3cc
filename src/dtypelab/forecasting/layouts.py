"""How a policy's converted model is laid out, for a forecast: the key under which two policies share a traced pass
(the same converted layout and forward), the stand-in traced for a conversion this machine cannot make, and what
the kinds' conversions took and left out."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtypelab.core.errors import DtypelabError, describe_exception
from dtypelab.core.policies import Cast, Plan, Precision, regions
from dtypelab.forecasting.adapters import PLAIN_PASS, STORED_WEIGHT_BYTES


def layout(model: nn.Module, plan: Plan) -> tuple[Any, ...]:
    """What decides an inference pass's memory, from the converted model: every module's type and region, every
    parameter's and buffer's type, dtype and shape, and the forward's autocast; two plans with the same layout (bf16,
    bf16-sr, bf16-kahan: the optimizer aside) run the same inference."""
    placed = {name: r.config.label for name, r in regions(model).items()}

    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        # a quantized weight's subclass says in its flatten context how it runs (int8-dyn and int8-wo store the same
        # Int8Tensor; only the first quantizes the activations too)
        ctx = repr(t.__tensor_flatten__()[1]) if is_traceable_wrapper_subclass(t) else ""
        return type(t).__name__, str(t.dtype), tuple(t.shape), t.requires_grad, ctx

    modules = tuple((n, type(m).__name__, placed.get(n, "")) for n, m in model.named_modules())
    tensors = tuple((n, *tensor(t)) for n, t in [*model.named_parameters(), *model.named_buffers()])
    # a kind whose passes are not the model's own shares them with no other kind
    own = () if PLAIN_PASS(plan.default) else (type(plan.default).__qualname__, plan.default)
    facts = plan.default.facts
    return (modules, tensors, facts.autocast_dtype, facts.storage_dtype, plan.checkpoint, plan.loss, *own)


def stand_in(plan: Plan, meta: nn.Module, exc: Exception, round_to: int) -> tuple[Plan, int]:
    """The plan with each config whose conversion failed here replaced by a cast to its stored dtype, and the
    bytes its converted weights take beyond that cast's (``layout_bytes``)."""
    layout = [c for c in plan.configs if STORED_WEIGHT_BYTES.registered(c)]
    if not layout:
        raise DtypelabError(f"converting the model failed: {describe_exception(exc)}") from exc
    swap = {c: Cast(c.facts.storage_dtype) for c in layout}
    stand = Plan(swap.get(plan.default, plan.default), tuple((p, swap.get(c, c)) for p, c in plan.rules),
                 name=plan.name, distributed=plan.distributed, state=plan.state)
    return stand, sum(layout_bytes(plan, meta, round_to).values())


def layout_bytes(plan: Plan, meta: nn.Module, round_to: int) -> dict[str, int]:
    """Each module whose kind stores its weight in a layout of its own (``STORED_WEIGHT_BYTES``, the one answer
    training and serving forecasts share): the bytes that layout takes beyond the weight in its stored dtype (each
    of the layout's tensors a block of its own where the allocator rounds to ``round_to``)."""
    modules = dict(meta.named_modules(remove_duplicate=False))
    kept = set().union(*(c.leaves(meta) for c in plan.configs))
    out = {}
    for name, config in plan.assign(meta).items():
        if name in kept:  # left as it is (a weight format's output head)
            continue
        stored = STORED_WEIGHT_BYTES(config, modules[name])  # None: the kind's tensors are traced as they are
        if stored is not None:
            weight = modules[name].weight
            out[name] = stored - weight.numel() * getattr(torch, config.facts.storage_dtype).itemsize + (
                round_to if round_to > 1 else 0)
    return out


def conversion_notes(precision: Precision, plan: Plan) -> list[str]:
    """What the kinds' conversions took and left out (float8 leaves small layers in bfloat16), from the precision
    that converted the model."""
    conv = precision.conversion()
    if not conv.get("left_out"):
        return []
    why = conv["left_out"][0]["why"]
    return [f"{conv.get('format', plan.name)}: {len(conv.get('converted', []))} layers converted, "
            f"{len(conv['left_out'])} left as they are ({conv['left_out'][0]['layer']}: {why})"]
