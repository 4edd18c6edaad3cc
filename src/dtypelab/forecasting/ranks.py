"""Several ranks in one process: torch's fake process group (``backend="fake"``, the way torchtitan's memory
estimator does it), on which FSDP2 shards a model as it would over ``nproc`` real ranks while this process plays
rank 0. Its collectives return at once, with fake kernels for fake tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Plan


class FakeRanks:
    """The fake process group, started on first use and destroyed by ``close`` (no process group outlives it)."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self._mesh: Any = None

    def wrap(self, plan: Plan) -> Callable[[nn.Module], nn.Module] | None:
        """How ``plan``'s model is wrapped on the ranks: FSDP2's units; None for DDP (it shards nothing: its
        gradient buckets are added to the traced step) and for a plan on one process."""
        if plan.distributed is None or plan.distributed.strategy != "fsdp":
            return None
        if self._mesh is None:
            from torch import distributed as dist
            from torch.distributed._tools import fake_collectives  # noqa: F401  the collectives' fake kernels
            from torch.distributed.device_mesh import init_device_mesh
            from torch.testing._internal.distributed.fake_pg import FakeStore  # the "fake" backend's store

            if dist.is_initialized():
                raise DtypelabError("forecast --nproc runs in a process of its own (torch.distributed is already "
                                    "initialized here)")
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.nproc)
            self._mesh = init_device_mesh("cpu", (self.nproc,))  # outside the fake tensors: it reads its ranks
        from dtypelab.distributed import wrap_fsdp

        spec, mesh = plan.distributed, self._mesh
        return lambda model: wrap_fsdp(model, spec, torch.device("cpu"), mesh=mesh)

    def close(self) -> None:
        if self._mesh is not None:
            from torch import distributed as dist

            dist.destroy_process_group()
            self._mesh = None
