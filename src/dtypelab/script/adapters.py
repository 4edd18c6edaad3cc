"""What the Lightning and Hugging Face integrations ask of a precision kind: Lightning's ``precision=`` value
(``LIGHTNING_PRECISION``; none: Lightning runs the kind through its own hooks as a precision plugin) and the
Trainer's ``TrainingArguments`` flags with the dtype to load the model in (``HF_ARGUMENTS``; none: the Trainer
cannot run it). A kind of your own registers its answers in its file (``core.policies.adapters``)."""

from __future__ import annotations

from typing import Any

from dtypelab.core.policies import Autocast, Cast
from dtypelab.core.policies.adapters import Adapter, constant
from dtypelab.core.policies.kinds.lora import LoRA
from dtypelab.core.policies.kinds.tf32 import TF32
from dtypelab.core.policies.kinds.training_state import LowBitState

LIGHTNING_PRECISION: Adapter[str | None] = Adapter("Lightning's precision= value", constant(None))
HF_ARGUMENTS: Adapter[tuple[dict[str, Any], str | None] | None] = Adapter(
    "the Trainer's TrainingArguments flags and the dtype the model is loaded in", constant(None))

_CAST = {"float64": "64-true", "float32": "32-true", "bfloat16": "bf16-true", "float16": "16-true"}
_AUTOCAST = {"bfloat16": "bf16-mixed", "float16": "16-mixed"}

LIGHTNING_PRECISION.register(Cast)(lambda config: _CAST[config.dtype])
LIGHTNING_PRECISION.register(Autocast)(lambda config: _AUTOCAST[config.dtype])


LIGHTNING_PRECISION.register(TF32)(constant("32-true"))  # with the TF32 flags the session sets for the whole run


@HF_ARGUMENTS.register(Cast)
def _cast_arguments(config: Cast) -> tuple[dict[str, Any], str | None]:
    return {}, None if config.dtype == "float32" else config.dtype  # as loading with that torch_dtype would


@HF_ARGUMENTS.register(Autocast)
def _autocast_arguments(config: Autocast) -> tuple[dict[str, Any], str | None]:
    return {"bf16" if config.dtype == "bfloat16" else "fp16": True}, None


HF_ARGUMENTS.register(TF32)(constant(({"tf32": True}, None)))


@HF_ARGUMENTS.register(LoRA)
def _lora_arguments(config: LoRA) -> tuple[dict[str, Any], str | None]:
    # the model the Trainer is given is cast to the base's storage dtype, then converted by the kind (HF_CONVERTS); a
    # bfloat16 or quantized base computes under the Trainer's bf16 autocast, as the kind does
    return ({}, None) if config.base == "float32" else ({"bf16": True}, "bfloat16")


# Whether a kind converts the model before the Trainer gets it (LoRA: peft's adapters injected, or a peft model's own
# kept, the base in its format); the Trainer then builds its optimizer over what trains
HF_CONVERTS: Adapter[bool] = Adapter("whether the kind converts the model the Trainer is given", constant(False))
HF_CONVERTS.register(LoRA)(constant(True))


def trainer_arguments(plan: Any) -> tuple[dict[str, Any], str | None] | None:
    """A plan's ``HF_ARGUMENTS`` (its default's), or None where the Trainer cannot run it: a per-module plan, a kind
    without an answer. (A loss choice is refused for every script first: the runner's.)"""
    return None if plan.rules else HF_ARGUMENTS(plan.default)

# An optimizer-state modifier as the Trainer's own ``optim`` name (torchao's low-bit AdamW, transformers#31865):
# none, the Trainer has no such optimizer
HF_OPTIM: Adapter[str | None] = Adapter("the Trainer's optim name for an optimizer-state modifier", constant(None))
HF_OPTIM.register(LowBitState)(lambda config: {"8bit": "adamw_torch_8bit", "4bit": "adamw_torch_4bit"}.get(
    config.bits))

__all__ = ["HF_ARGUMENTS", "HF_CONVERTS", "HF_OPTIM", "LIGHTNING_PRECISION"]
