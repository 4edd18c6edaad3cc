"""An inference run times the evaluation's own forward passes when they have the timing batch's shapes: no pass is
run twice for timing, and passes of another shape are neither timed nor in the memory window."""

from __future__ import annotations

import torch
from torch import nn

from dtypelab.core.task import InferenceTask
from dtypelab.sweep.job import Job, run_job

CALLS: list[int] = []  # the batch size of every forward pass, in order


class Counting(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append(x.shape[0])
        return self.lin(x)


def _task(eval_sizes: tuple[int, ...]):
    def evaluate(predict) -> dict[str, float]:
        out = [predict(torch.ones(n, 8)) for n in eval_sizes]
        return {"mean": float(torch.cat(out).mean())}

    return InferenceTask("count", Counting, lambda n: torch.ones(n, 8), evaluate, "mean", batch_size=4, steps=6)


def _run(tmp_path, eval_sizes, **job):
    CALLS.clear()
    task = _task(eval_sizes)
    settings = {"steps": 6, "warmup": 1, **job}
    result = run_job(Job("count", "fp32", "infer", settings["steps"], 4, settings["warmup"], 0, "cpu",
                         str(tmp_path), time_box_s=job.get("time_box_s")), task=task)
    assert result.status == "ok", result.reason
    return result, list(CALLS)


def test_evaluation_passes_of_the_timing_shape_are_the_timed_steps(tmp_path):
    result, calls = _run(tmp_path, (4, 4, 4))
    assert len(result.step_times_s) == 6
    # prime's two throwaway passes (batch 2), three evaluation passes, three more to reach 6 steps
    assert calls == [2, 2, 4, 4, 4, 4, 4, 4]
    assert "mean" in result.metrics  # the evaluation ran and scored


def test_passes_of_another_shape_are_not_timed(tmp_path):
    result, calls = _run(tmp_path, (4, 3, 4))
    assert len(result.step_times_s) == 6
    assert calls[2:] == [4, 3, 4, 4, 4, 4, 4]  # the batch of 3 ran once, untimed: four passes fill the steps


def test_more_evaluation_passes_than_steps_are_timed_up_to_the_steps_only(tmp_path):
    result, calls = _run(tmp_path, (4,) * 9)
    assert len(result.step_times_s) == 6 and calls[2:] == [4] * 9  # nothing run for timing alone
