"""The built-in precision kinds, one module each; importing this package registers them all (``configs.KINDS``).

A new built-in kind is one file dropped here: ``import_all`` (run once the registry exists, at the end of
``dtypelab.core.policies``) imports every module of this package, and a module's ``register(...)`` calls name its
policies. The names below are re-exports for convenience, not the list of kinds."""

import importlib
import pkgutil

from dtypelab.core.policies.kinds.autocast import Autocast
from dtypelab.core.policies.kinds.cast import Cast
from dtypelab.core.policies.kinds.float8 import Float8Train
from dtypelab.core.policies.kinds.kv_cache import NATIVE, KVFormat
from dtypelab.core.policies.kinds.lora import LoRA
from dtypelab.core.policies.kinds.mx import MXInfer, MXTrain
from dtypelab.core.policies.kinds.quantize import Quantize
from dtypelab.core.policies.kinds.tf32 import TF32
from dtypelab.core.policies.kinds.training_state import BF16Update, LowBitState
from dtypelab.core.policies.kinds.weight_quant import WeightQuant

__all__ = ["NATIVE", "TF32", "Autocast", "BF16Update", "Cast", "Float8Train", "KVFormat", "LoRA", "LowBitState",
           "MXInfer", "MXTrain", "Quantize", "WeightQuant"]


def import_all() -> list[str]:
    """Import every module of this package (a kind registers itself when defined); the names imported."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg]
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names
