"""A model wrapped for data-parallel training the way the modifier says: DDP with a communication hook, or FSDP2
(``fully_shard``) with a mixed-precision policy. torch.distributed does the work; nothing here sends data itself.

Every DDP variant runs through a Python hook, so that each collective passes ``torch.distributed`` where it is
counted: no modifier is torch's ``allreduce_hook`` (what DDP does without one), fp16 is torch's
``fp16_compress_hook``, PowerSGD is torch's ``powerSGD_hook``. bf16 is torch's ``bf16_compress_hook`` on NCCL;
elsewhere DDP refuses that hook by name ("requires CUDA 11+ and NCCL 2.10+") although gloo all-reduces bfloat16
tensors, so the same three steps (cast, all-reduce, cast back) are registered under their own name.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from dtypelab.core.policies import Distributed
from dtypelab.core.policies.checkpointing import repeated_blocks


def bf16_allreduce_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradients averaged in bfloat16: cast, all-reduce, cast back into the bucket. (Its name is not torch's, which
    DDP would refuse off NCCL.)"""
    world = dist.get_world_size(group)
    compressed = bucket.buffer().to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


# DDP checks the hook's annotations as objects; ``from __future__ import annotations`` made them strings
bf16_allreduce_hook.__annotations__ = {"group": Any, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}


def _one_bucket_at_a_time(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD hook, each bucket finished before the next starts. PowerSGD issues its second all-reduce
    from the first one's completion callback; with several buckets those callbacks run in whatever order their
    all-reduces complete, and gloo, which matches collectives by the order ranks issue them, then pairs different
    tensors across ranks and aborts ("Received data size doesn't match expected size"). NCCL runs the hook as is."""
    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


_one_bucket_at_a_time.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                         "return": torch.futures.Future[torch.Tensor]}


def wrap_ddp(model: nn.Module, spec: Distributed, device: torch.device, group: Any = None) -> nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=group)
    if spec.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=spec.rank,
                                            start_powerSGD_iter=spec.start_iter, use_error_feedback=True,
                                            warm_start=True, random_seed=0)
        hook = powerSGD_hook.powerSGD_hook if dist.get_backend(group) == "nccl" else _one_bucket_at_a_time
        ddp.register_comm_hook(state, hook)
    elif spec.hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif spec.hook == "bf16":
        nccl = dist.get_backend(group) == "nccl"
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook if nccl else bf16_allreduce_hook)
    else:
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    return ddp


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, before the root: each repeated block (a ``ModuleList`` or
    ``Sequential`` of blocks of one class, wherever it sits: ``layers.0`` … ``layers.31``), as torchtitan and
    accelerate wrap a transformer's blocks, so that one block's weights are gathered at a time; a model that repeats
    nothing: each top-level child that holds parameters. A unit that shares a parameter with another (tied
    embeddings) stays in the root's, since FSDP2 refuses a parameter that two units hold."""
    inner = model.__dict__.get("_lab_module", model)
    blocks = [inner.get_submodule(name) for name in repeated_blocks(inner)]
    units = blocks or [c for c in model.children() if any(True for _ in c.parameters())]
    holders = Counter(id(p) for u in units for p in u.parameters())
    return [u for u in units if all(holders[id(p)] == 1 for p in u.parameters())]


def wrap_fsdp(model: nn.Module, spec: Distributed, device: torch.device, group: Any = None,
              mesh: Any = None) -> nn.Module:
    """FSDP2: a unit per repeated block (``fsdp_units``), then the root. ``mesh``: a device mesh made beforehand
    (the forecast makes it outside its fake tensors); else one over ``group`` or the whole world."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = (init_device_mesh(device.type, (dist.get_world_size(),)) if group is None
                else DeviceMesh.from_group(group, device.type))
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, spec.param_dtype) if spec.param_dtype else None,
                              reduce_dtype=getattr(torch, spec.reduce_dtype) if spec.reduce_dtype else None)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def wrap(model: nn.Module, spec: Distributed, device: torch.device, group: Any = None) -> nn.Module:
    return (wrap_fsdp if spec.strategy == "fsdp" else wrap_ddp)(model, spec, device, group)


def unwrapped_state(model: nn.Module, spec: Distributed) -> dict[str, torch.Tensor] | None:
    """The full state dict (CPU tensors) on rank 0, None elsewhere; every rank must call it."""
    if spec.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if dist.get_rank() == 0 else None
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
