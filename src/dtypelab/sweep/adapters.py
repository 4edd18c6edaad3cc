"""What bench asks of a precision kind beyond its hooks: for an emulated format, what its numerics did to each layer
it converted on the inputs one forward pass gives it (``EMULATION_FIDELITY``: SQNR against bfloat16, values flushed to
zero; none by default). A kind of your own registers its answer in its file (``core.policies.adapters``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dtypelab.core.policies import Config, Float8Train
from dtypelab.core.policies.adapters import Adapter, constant
from dtypelab.core.policies.kinds.mx import MXTrain, mx_roundtrip

EMULATION_FIDELITY: Adapter[list[dict[str, Any]]] = Adapter("an emulated format's fidelity per converted layer",
                                                        constant([]))


@EMULATION_FIDELITY.register(Float8Train)
def _float8(config: Float8Train, model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Emulated float8 training: each converted layer's float8 numerics against bfloat16, on ``run``'s inputs."""
    if not config.emulate:
        return []
    from dtypelab.core.emulation import emulated_layers

    return emulated_layers(model, run, config.recipe)


@EMULATION_FIDELITY.register(MXTrain)
def _mx(config: MXTrain, model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Emulated mxfp8 training: the layers torchao wrapped, their mxfp8 numerics against bfloat16."""
    if not config.emulate:
        return []
    from dtypelab.core.emulation import emulated_layers

    converted = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                 and type(m.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"]
    return emulated_layers(model, run, "mxfp8", names=converted, roundtrip=mx_roundtrip)


def emulation_fidelity(configs: tuple[Config, ...], model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Every config of a plan's rows, in the plan's order."""
    return [row for config in configs for row in EMULATION_FIDELITY(config, model, run)]


__all__ = ["EMULATION_FIDELITY", "emulation_fidelity"]
