"""One policy's data-parallel training, run on every rank that torchrun started: ``DistributedJob`` is the piece of
work ``dtypelab.run``'s torchrun launcher sends each rank (it joins the process group, trains, leaves with its
peers, and returns the result on rank 0).

- The global batch is the task's own ``batch(step, batch_size)``, identical to the single-process run's; each
  rank takes its contiguous 1/N slice along the batch dimension (the first dimension whose size is the batch
  size), so N ranks together see exactly the batch one process would.
- The initial weights are built from the seed and broadcast from rank 0: identical on every rank, on every node.
- Step times: each rank's own, then the slowest rank per step. Losses: the mean over ranks per step (equal shards:
  the global batch's mean). Memory: each rank's peak above its baseline. Metric: rank 0, on the full weights.
- Collectives are counted while the steps run (``collectives.Counter``); afterwards the same step is timed on a
  one-rank group per rank (the hooks' and FSDP's casts, no peer: the compute the scaling estimate starts from),
  and the link between the ranks is measured.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from dtypelab.core.errors import DtypelabError
from dtypelab.core.loop import (
    build_model,
    build_trainable,
    evaluate,
    fingerprint,
    prime,
    threads,
    to_device,
    train_step,
)
from dtypelab.core.measure import MemoryMeter, StepTimer, device_sync
from dtypelab.core.policies import Distributed, Plan, Precision, get_policy, policy_info
from dtypelab.core.results import DistStats, PolicyResult
from dtypelab.core.task import Task, load_task, map_tensors, tensors
from dtypelab.distributed.collectives import Counter, measure_link, wire_factor
from dtypelab.distributed.wrap import unwrapped_state, wrap


@dataclass(frozen=True)
class DistributedJob:
    """Everything every rank needs, picklable: the task travels as its spec, the policy as its plan."""

    task_spec: str
    plan: Plan
    steps: int
    batch_size: int
    warmup: int
    seed: int
    device: str
    workdir: str
    threads: int | None = None
    nnodes: int = 1
    timeout_s: float = 600.0  # also the process group's: a rank that waits longer for its peers gives up

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", get_policy(self.plan))

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def policy(self) -> str:
        return self.plan.name

    def __call__(self, report: Any) -> PolicyResult | None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = self.device.startswith("cuda")
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        start = time.perf_counter()
        try:
            if cuda:
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            with threads(self.threads):
                result = train_distributed(load_task(self.task_spec), self, device, report, self.nnodes)
            # leave together: a gloo rank tearing down while its peer still works (rank 0 evaluating) can abort
            dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if result is None:
            return None
        return replace(result, info=policy_info(self.plan), wall_s=time.perf_counter() - start)


Job = DistributedJob
COMPUTE_STEPS = 12  # timed steps on the one-rank groups (after 2 warm-ups)


def batch_dim(batch: Any, batch_size: int) -> int:
    """The batch dimension: the first dimension whose size is ``batch_size`` in every tensor that has one."""
    dims = [next((d for d, n in enumerate(t.shape) if n == batch_size), -1) for t in tensors(batch)]
    found = {d for d in dims if d >= 0}
    if len(found) != 1:
        raise DtypelabError(f"cannot split the batch across ranks: no single dimension of size {batch_size} in "
                            f"the batch's tensors (shapes: {', '.join(str(tuple(t.shape)) for t in tensors(batch))})")
    return found.pop()


def shard(batch: Any, rank: int, world: int, batch_size: int) -> Any:
    """This rank's contiguous slice of the global batch."""
    dim, per = batch_dim(batch, batch_size), batch_size // world

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, rank * per, per) if t.dim() > dim and t.shape[dim] == batch_size else t

    return map_tensors(cut, batch)


def _broadcast_weights(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fresh(task: Task, job: Job, precision: Precision, spec: Distributed, device: torch.device,
           group: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(task, job.seed).to(device)  # on the device first: NCCL broadcasts device tensors
    if group is None:
        _broadcast_weights(model)
    return build_trainable(task, precision, device, model=model,
                           wrap=lambda converted: wrap(converted, spec, device, group))


def train_distributed(task: Task, job: Job, device: torch.device, progress: Callable[[int, int], None],
                      nnodes: int = 1) -> PolicyResult | None:
    """Rank 0 returns the policy's result; the other ranks None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = job.plan.distributed or Distributed()
    if job.batch_size % world:
        raise DtypelabError(f"the batch size {job.batch_size} does not split over {world} ranks: give "
                            f"--batch-size a multiple of {world}")
    precision = Precision(job.plan, device)
    if device.type == "cpu":
        prime(task, job.plan, device, job.batch_size // world, train=True)
    meter = MemoryMeter(device)
    meter.start()
    init = fingerprint(build_model(task, job.seed))  # before the broadcast: the seed's weights, as single-process
    wrapped, optimizer = _fresh(task, job, precision, spec, device)
    meter.open_window()
    timer, counter, losses = StepTimer(sync=device_sync(device)), Counter(), []
    torch.manual_seed(job.seed)  # as the single-process loop does
    with precision.session(), counter.active():
        for step in range(job.steps):
            inputs, target = to_device(shard(task.batch(step, job.batch_size), rank, world, job.batch_size), device)
            with counter.step():
                timer.start()
                loss = train_step(task, wrapped, precision, optimizer, inputs, target)
                timer.stop()
            losses.append(float(loss.detach()))
            progress(step + 1, job.steps)
    peak = meter.peak_bytes()
    skip = max(job.warmup, spec.start_iter if spec.hook == "powersgd" else 0)
    comm = counter.summary(skip)
    compute = _compute_time(task, job, precision, spec, device, inputs, target)
    link = measure_link(device)
    state = unwrapped_state(wrapped, spec)
    gathered = _gather({"steps": timer.samples, "losses": losses, "peak": peak, "compute": compute})
    if rank != 0:
        return None
    step_times = tuple(max(g["steps"][i] for g in gathered) for i in range(len(timer.samples)))
    mean_losses = tuple(statistics.fmean(g["losses"][i] for g in gathered) for i in range(len(losses)))
    bad = next((i for i, v in enumerate(mean_losses) if not math.isfinite(v)), None)
    diverged = bad is not None and not math.isfinite(mean_losses[-1])
    assert state is not None  # rank 0's, whole
    metrics = {} if diverged else _metrics(task, job, precision, state, device)
    wire = sum(int(wire_factor(kind, world) * n) for kind, n in comm["bytes"].items())
    stats = DistStats(
        nproc=world // max(nnodes, 1), nnodes=nnodes, backend=dist.get_backend(), strategy=spec.strategy,
        modifier=spec.label, payload_bytes=comm["bytes"], wire_bytes=wire, collectives=comm["calls"],
        comm_in_flight_s=comm["in_flight_s"], compute_s=max(g["compute"] for g in gathered),
        rank_peak_bytes=tuple(int(g["peak"] or 0) for g in gathered),
        rank_step_s=tuple(statistics.median(g["steps"][job.warmup:] or g["steps"]) for g in gathered),
        link_latency_s=link["latency_s"], link_gbps=link["gbps"], link_probe_bytes=int(link["probe_bytes"]))
    return PolicyResult(
        policy=job.policy, status="diverged" if diverged else "ok",
        reason=f"mean loss over ranks non-finite from step {bad}" if diverged else "", batch_size=job.batch_size,
        warmup=min(job.warmup, max(0, len(step_times) - 1)), step_times_s=step_times, losses=mean_losses,
        first_nonfinite_step=bad, metrics=metrics, peak_memory_bytes=max(int(g["peak"] or 0) for g in gathered),
        memory_method=f"{meter.method}; the largest of {world} ranks", init_fingerprint=init,
        scaler=precision.stats(), distributed=stats)


def _metrics(task: Task, job: Job, precision: Precision, state: dict[str, torch.Tensor], device: torch.device,
             ) -> dict[str, float]:
    """The task's metrics of the trained weights (rank 0's, gathered whole), on one model as a single process."""
    model = precision.convert_module(build_model(task, job.seed).to(device))
    model.load_state_dict(state)
    with precision.session():
        return evaluate(task, model, precision, device)


def _compute_time(task: Task, job: Job, precision: Precision, spec: Distributed, device: torch.device,
                  inputs: Any, target: Any) -> float:
    """This rank's median step with the same wrapper on a group of its own (every rank at once, so the CPU is
    shared as in the real run): what the step costs without a peer to talk to."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    solo = groups[dist.get_rank()]
    precision = Precision(job.plan, device)  # its own GradScaler: the measured run's stays as it ended
    wrapped, optimizer = _fresh(task, job, precision, spec, device, group=solo)
    timer = StepTimer(sync=device_sync(device))
    with precision.session():
        for _ in range(2):  # warm-up
            train_step(task, wrapped, precision, optimizer, inputs, target)
        for _ in range(COMPUTE_STEPS):
            timer.start()
            train_step(task, wrapped, precision, optimizer, inputs, target)
            timer.stop()
    dist.barrier()
    return statistics.median(timer.samples)
