"""What the autopilot asks of a precision kind: whether a layer may be moved into it while training goes on
(``PROMOTABLE``: casts and autocast), and where it moves a layer at risk in it (``PROMOTION``; none: float32). A
kind of your own registers its answers in its file (``core.policies.adapters``)."""

from __future__ import annotations

from dtypelab.core.policies import Autocast, Cast, Config
from dtypelab.core.policies.adapters import Adapter, constant

PROMOTABLE: Adapter[bool] = Adapter("whether the autopilot may move a layer into this kind", constant(False))
PROMOTION: Adapter[Config | None] = Adapter("where the autopilot moves a layer at risk in this kind", constant(None))

PROMOTABLE.register(Cast, Autocast)(constant(True))


@PROMOTION.register(Cast, Autocast)
def _to_bfloat16(config: Cast | Autocast, bf16_fast: bool) -> Config | None:
    """float16's range is what fails: bfloat16 keeps float32's, where it runs natively; else float32 (None)."""
    return type(config)("bfloat16") if config.dtype == "float16" and bf16_fast else None


__all__ = ["PROMOTABLE", "PROMOTION"]
