"""The forecast's work, in a worker process: a ``Work`` of ``dtypelab.run`` that takes its share of the policies'
families (several workers share them through a claims folder) and forecasts each with a ``Forecaster``
(``forecasting.forecaster``), sending each result as it is made so that a crash or Ctrl-C keeps those done."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dtypelab.core.machine.speed import Rates
from dtypelab.core.policies import Plan, get_policy
from dtypelab.core.results import PolicyForecast
from dtypelab.core.task import Task, load_task
from dtypelab.forecasting import local_run
from dtypelab.forecasting.forecaster import Forecaster


@dataclass(frozen=True)
class ForecastJob:
    """Some policies' forecasts, run where a launcher puts it (picklable: the task travels as its spec)."""

    task_spec: str
    plans: tuple[Plan, ...]  # grouped into families (``groups``), the largest first
    batch_size: int  # per rank
    infer_batch_size: int
    target: str  # cuda or cpu
    nproc: int = 1
    seed: int = 0
    limit: int | None = None  # usable bytes per rank: search the largest batch that fits
    search: bool = True
    check: bool = False
    check_device: str = "cpu"  # --check runs here, on this device
    part: int = 0
    device: str = "cpu"  # where the work runs (the launcher forks CPU work from its zygote)
    groups: tuple[int, ...] = ()  # how many plans each family has, in order (none: one family each)
    claims: str | None = None  # a folder shared with the other workers: each family is taken by whoever is free
    task: Task | None = field(default=None, compare=False)  # a Task object (this process only: it does not pickle)
    rates: Rates | None = field(default=None, compare=False)  # the target's, for the time model (None: no time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(get_policy(p) for p in self.plans))

    @property
    def name(self) -> str:
        return f"forecast-{self.part}"

    def __call__(self, report: Any) -> tuple[int, list[PolicyForecast]]:
        """(the model's parameter count, each policy's forecast)."""
        forecaster = Forecaster(self, self.task or load_task(self.task_spec))
        count = sum(p.numel() for p in forecaster.meta.parameters())  # shared (tied) parameters once
        report.send("parameters", count)  # kept if the run is stopped before it returns
        out: list[PolicyForecast] = []
        try:
            for family in self._families():
                if not self._claim(family[0].name):
                    continue  # another worker took it
                for plan in family:
                    result = forecaster.policy(plan)
                    report.send(f"policy:{plan.name}", result)  # kept by the launcher even if a later one crashes
                    out.append(result)
                    report.step(len(out), len(self.plans))
            out = local_run.retimed(forecaster, out)  # this CPU's kernels and steps again, in rounds
            for result in out:
                report.send(f"policy:{result.policy}", result)
        finally:
            forecaster.close()
        return count, out

    def _families(self) -> list[list[Plan]]:
        sizes = self.groups or (1,) * len(self.plans)
        out, i = [], 0
        for n in sizes:
            out.append(list(self.plans[i:i + n]))
            i += n
        return out

    def _claim(self, name: str) -> bool:
        """Take a family for this worker (whoever creates its file first); always, without a claims folder."""
        if self.claims is None:
            return True
        try:
            fd = os.open(os.path.join(self.claims, name.replace("/", "_")), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(self.part).encode())
        os.close(fd)
        return True


__all__ = ["ForecastJob"]
