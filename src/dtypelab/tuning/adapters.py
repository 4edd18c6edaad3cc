"""What ``tune`` asks of a precision kind: the modes in which it may give single layers that kind (``TUNES``; none
by default), the layers it may give it (``LAYER_TYPES``: any leaf with weights for a cast, Linear layers for the
formats that quantize), and the float dtype other than float32 a layer's values take in it, whose range the range
audit checks (``RANGE_DTYPE``). A kind of your own registers its answers in its file (``core.policies.adapters``)."""

from __future__ import annotations

from torch import nn

from dtypelab.core.policies import Autocast, Cast
from dtypelab.core.policies.adapters import Adapter, constant
from dtypelab.core.policies.kinds.float8 import Float8Train
from dtypelab.core.policies.kinds.mx import MXInfer, MXTrain
from dtypelab.core.policies.kinds.quantize import Quantize
from dtypelab.core.policies.kinds.training_state import BF16Update

TUNES: Adapter[tuple[str, ...]] = Adapter("the modes in which tune may give single layers this kind", constant(()))
LAYER_TYPES: Adapter[tuple[type[nn.Module], ...]] = Adapter(
    "the layers tune may give this kind", constant((nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)))
RANGE_DTYPE: Adapter[str | None] = Adapter("the dtype whose range tune's audit checks", constant(None))

TUNES.register(Cast, Autocast)(constant(("train", "infer")))
TUNES.register(BF16Update, Float8Train)(constant(("train",)))
TUNES.register(MXInfer, Quantize)(constant(("infer",)))
LAYER_TYPES.register(Float8Train, MXTrain, MXInfer, Quantize)(constant((nn.Linear,)))
RANGE_DTYPE.register(Cast)(lambda c: None if c.dtype == "float32" else c.dtype)
RANGE_DTYPE.register(Autocast)(lambda c: c.dtype)
RANGE_DTYPE.register(BF16Update)(constant("bfloat16"))

__all__ = ["LAYER_TYPES", "RANGE_DTYPE", "TUNES"]
