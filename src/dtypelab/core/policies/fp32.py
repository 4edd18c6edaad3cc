"""float32: the baseline every other policy is compared against."""

from dtypelab.core.policies.base import Policy


class FP32(Policy):
    name = "fp32"
    summary = "float32 everywhere (baseline)"
