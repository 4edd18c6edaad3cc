"""What bench asks of a precision kind beyond its hooks: for an emulated format, what its numerics did to each layer
it converted on the inputs one forward pass gives it (``LAYER_FIDELITY``: SQNR against bfloat16, values flushed to
zero; none by default). A kind of your own registers its answer in its file (``core.policies.adapters``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dtypelab.core.policies import Config, Float8Train
from dtypelab.core.policies.adapters import Adapter, constant
from dtypelab.core.policies.kinds.mx import MXTrain

LAYER_FIDELITY: Adapter[list[dict[str, Any]]] = Adapter("an emulated format's fidelity per converted layer",
                                                        constant([]))


@LAYER_FIDELITY.register(Float8Train, MXTrain)
def _emulated(config: Float8Train | MXTrain, model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    return config.layer_fidelity(model, run)


def plan_fidelity(configs: tuple[Config, ...], model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Every config of a plan's rows, in the plan's order."""
    return [row for config in configs for row in LAYER_FIDELITY(config, model, run)]


__all__ = ["LAYER_FIDELITY", "plan_fidelity"]
