"""What the forecast asks of a precision kind: the bytes a module's weight takes once the kind converted it, from
the format's layout (``STORED_WEIGHT_BYTES``), for a conversion the machine forecasting cannot make (a format whose
conversion needs CUDA): the weights' bytes come from here, the rest of the step from a trace with the kind's
``storage_dtype`` in their place. A kind whose conversion runs anywhere needs none (its converted tensors are traced);
a kind of your own registers its answer in its file (``core.policies.adapters``)."""

from __future__ import annotations

from torch import nn

from dtypelab.core.policies import TF32, Autocast, Cast, Quantize, WeightQuant
from dtypelab.core.policies.adapters import Adapter, constant
from dtypelab.core.policies.kinds.training_state import BF16Update

STORED_WEIGHT_BYTES: Adapter[int | None] = Adapter("the bytes a module's weight takes in the kind's layout",
                                                   constant(None))


@STORED_WEIGHT_BYTES.register(Quantize, WeightQuant)
def _quantized(config: Quantize | WeightQuant, module: nn.Module) -> int | None:
    """The kind's own answer (``Quantize.stored_bytes``: each scheme's layout is said in its file)."""
    return config.stored_bytes(module)


# Plans whose kinds run the model's own forward and backward (no module conversion, no forward context or output
# conversion beyond their storage and autocast dtypes) share one traced pass per layout: bf16, bf16-sr and
# bf16-kahan differ only in the update. A kind that registers nothing is traced on its own (safe, only slower).
PLAIN_PASS: Adapter[bool] = Adapter("whether the kind's passes are the model's own in its dtypes", constant(False))
PLAIN_PASS.register(Cast, Autocast, TF32, BF16Update)(constant(True))

# How costly a kind's update is to trace, against a plain optimizer's 1 (the forecast hands the costliest families
# out first): torch-optimi's bf16 updates step one parameter at a time
UPDATE_COST: Adapter[int] = Adapter("what the kind's update costs to trace", constant(1))
UPDATE_COST.register(BF16Update)(constant(5))

__all__ = ["PLAIN_PASS", "STORED_WEIGHT_BYTES", "UPDATE_COST"]
