"""A task's batch from its shapes alone: which dimensions grow with the batch size, learnt from two small real
batches, so that a trace can take any size without generating the data; and the split of a batch into the inputs and
target the loop takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dtypelab.core.errors import TaskError
from dtypelab.core.task import Task


@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]  # at batch size 1 for the dimensions that grow (their per-sample size)
    grows: tuple[bool, ...]  # which dimensions are proportional to the batch size
    dtype: torch.dtype


@dataclass(frozen=True)
class BatchShape:
    """How a batch's tensors grow with the batch size, learnt from two small real batches: a dimension that is k·b at
    both sizes is k·b at every size; the rest stay as they are. Anything else in the batch (numbers, strings) is kept
    from the first."""

    spec: Any
    leaves: tuple[Leaf | Any, ...]

    @classmethod
    def of(cls, make: Callable[[int], Any], what: str) -> BatchShape:
        (a, spec), (b, spec_b) = tree_flatten(make(2)), tree_flatten(make(3))
        if spec != spec_b or len(a) != len(b):
            raise TaskError(f"{what} returns batches of different structure at batch sizes 2 and 3")
        leaves: list[Leaf | Any] = []
        for x, y in zip(a, b, strict=True):
            if not isinstance(x, torch.Tensor):
                leaves.append(x)
                continue
            if x.dim() != y.dim() or x.dtype != y.dtype:
                raise TaskError(f"{what}: a tensor of the batch changes rank or dtype with the batch size")
            shape, grows = [], []
            for n2, n3 in zip(x.shape, y.shape, strict=True):
                if n2 == n3:
                    shape.append(n2)
                    grows.append(False)
                elif n2 % 2 == 0 and n3 == n2 // 2 * 3:
                    shape.append(n2 // 2)
                    grows.append(True)
                else:
                    raise TaskError(f"{what}: a dimension of the batch is {n2} at batch size 2 and {n3} at 3, not in "
                                    "proportion to the batch size, so its size at another batch size is unknown")
            leaves.append(Leaf(tuple(shape), tuple(grows), x.dtype))
        return cls(spec, tuple(leaves))

    def build(self, batch_size: int) -> Any:
        """The batch at ``batch_size``, as empty tensors (fake ones under a FakeTensorMode)."""
        out = []
        for leaf in self.leaves:
            if isinstance(leaf, Leaf):
                shape = tuple(n * batch_size if g else n for n, g in zip(leaf.shape, leaf.grows, strict=True))
                out.append(torch.empty(shape, dtype=leaf.dtype))
            else:
                out.append(leaf)
        return tree_unflatten(out, self.spec)


def split(task: Task, data: Any) -> tuple[Any, Any]:
    """(inputs, target) from what ``train_batch`` returns, as ``Task.batch`` splits it."""
    if task.compute_loss is not None:
        return data, None
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise TaskError(f"task {task.name!r}: train_batch must return (inputs, target) for loss_fn")
    return data[0], data[1]


def fetched(batch: BatchShape | Callable[[int], Any], steps: int) -> list[Any] | None:
    """A real run's batches, fetched before the count starts: a batch sliced from the task's data set is a view of
    it, whose storage (the whole set) the task holds anyway; the step's own batch is the copy made of it."""
    return None if isinstance(batch, BatchShape) else [batch(step) for step in range(steps)]


def train_batch_shape(task: Task) -> BatchShape:
    return BatchShape.of(lambda b: task.train_batch(0, b), f"task {task.name!r}: train_batch")


def infer_batch_shape(task: Task) -> BatchShape:
    return BatchShape.of(task.inference_inputs, f"task {task.name!r}: its inference batch")
