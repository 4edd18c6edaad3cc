"""The built-in precision kinds, one module each; importing this package registers them all (``Config.KINDS``)."""

from dtypelab.core.policies.kinds.autocast import Autocast
from dtypelab.core.policies.kinds.cast import Cast
from dtypelab.core.policies.kinds.float8 import Float8Train
from dtypelab.core.policies.kinds.lora import LoRA
from dtypelab.core.policies.kinds.mx import MXInfer, MXTrain
from dtypelab.core.policies.kinds.quantize import Quantize
from dtypelab.core.policies.kinds.state import BF16Update, LowBitState
from dtypelab.core.policies.kinds.tf32 import TF32

__all__ = ["TF32", "Autocast", "BF16Update", "Cast", "Float8Train", "LoRA", "LowBitState", "MXInfer", "MXTrain",
           "Quantize"]
