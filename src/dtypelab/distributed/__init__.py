"""Distributed policies (``bench --nproc``): one policy's data-parallel training on every rank torchrun starts
(job, train), DDP hooks and FSDP2 (wrap), the bytes each collective sends and the link (collectives), and the
ring-model scaling estimate (scaling)."""

from dtypelab.distributed.options import torchrun_settings
from dtypelab.distributed.scaling import estimate, parse_links, predict, with_scaling
from dtypelab.distributed.train import DistributedJob
from dtypelab.distributed.wrap import wrap_fsdp

__all__ = ["DistributedJob", "estimate", "parse_links", "predict", "torchrun_settings", "with_scaling", "wrap_fsdp"]
