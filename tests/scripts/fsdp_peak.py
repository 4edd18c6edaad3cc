"""A real FSDP2 run on two ranks (gloo, this CPU), its training step counted by the forecast's own ledger on real
tensors: what ``forecast TASK --nproc 2 -p fp32+fsdp`` traces on fake tensors and a fake process group.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/fsdp_peak.py TASK GLOBAL_BATCH OUT.json

Rank 0 writes {"peak_bytes", "breakdown", "units"} to OUT.json."""

import functools
import json
import sys
import time

import torch
import torch.distributed as dist

from dtypelab.core.policies import get_policy
from dtypelab.core.task import load_task
from dtypelab.distributed.wrap import fsdp_units, wrap_fsdp
from dtypelab.forecasting.fake_step import Run, Target


def settled(collective):
    """The collective, then a pause holding no GIL: gloo's worker thread marks the call done before it drops its
    references to the call's tensors, and that drop (freeing them) waits for the GIL, so without the pause a buffer
    lives on into the next ops for as long as the main thread keeps the GIL (1 in 2 runs held one block's shard more
    at the peak). The forecast counts each buffer freed when its collective returns; so does this run, always."""

    @functools.wraps(collective)
    def call(*args, **kwargs):
        work = collective(*args, **kwargs)
        time.sleep(0.01)
        return work

    return call


for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
    setattr(dist, name, settled(getattr(dist, name)))
task_spec, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
task, plan = load_task(task_spec), get_policy("fp32+fsdp")
torch.manual_seed(0)
model = task.make_model()
units = len(fsdp_units(model))
run = Run(task, plan, model, Target("cpu"), fake=False,
          wrap=lambda m: wrap_fsdp(m, plan.distributed, torch.device("cpu")))
per_rank = batch // dist.get_world_size()
traced = run.train(lambda step: task.train_batch(step, per_rank), per_rank, steps=3)
if dist.get_rank() == 0:
    peak = traced.peak
    with open(out, "w") as f:
        json.dump({"peak_bytes": peak.total, "breakdown": dict(peak.breakdown), "units": units}, f)
dist.destroy_process_group()
