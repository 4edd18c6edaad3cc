"""The program torchrun starts on every rank: ``python -m dtypelab.distributed.worker RUNDIR``.

RUNDIR (written by ``launch.TorchrunLauncher``) holds ``job.pkl``. Each rank writes ``pid-<rank>`` (so the launcher
can make sure none outlives the job) and, when it fails, ``error-<rank>.txt`` with one line naming the user's code;
rank 0 writes ``progress`` (steps done, total) and finally ``result.pkl``. Never imported by the package.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from dtypelab.core.errors import describe_exception
from dtypelab.core.loop import threads
from dtypelab.core.policies import policy_info
from dtypelab.core.results import save_bytes
from dtypelab.core.task import load_task
from dtypelab.distributed.train import train_distributed
from dtypelab.sweep.launch import watch_parent

PROGRESS_EVERY_S = 0.2


def main(rundir: str) -> int:
    watch_parent()  # torchrun starts ranks in sessions of their own: if it is killed, they must not live on
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    save_bytes(os.path.join(rundir, f"pid-{rank}"), str(os.getpid()).encode())
    with open(os.path.join(rundir, "job.pkl"), "rb") as f:
        job, nnodes, timeout_s = pickle.load(f)
    cuda = job.device.startswith("cuda")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if rank == 0 and (now - last >= PROGRESS_EVERY_S or done == total):
            last = now
            save_bytes(os.path.join(rundir, "progress"), f"{done} {total}".encode())

    start = time.perf_counter()
    try:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        with threads(job.threads):
            result = train_distributed(load_task(job.task_spec), job, device, progress, nnodes)
        if rank == 0:
            result = replace(result, info=policy_info(job.plan), wall_s=time.perf_counter() - start)
            save_bytes(os.path.join(rundir, "result.pkl"), pickle.dumps(result))
        # leave together: a gloo rank tearing down while its peer still works (rank 0 evaluating) can abort
        dist.barrier()
    except BaseException as exc:  # every failure (SystemExit included) becomes this rank's one line
        save_bytes(os.path.join(rundir, f"error-{rank}.txt"), f"rank {rank}: {describe_exception(exc)}".encode())
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
