"""A script's policies each run once, in a process of their own: the steps of one run are not replicates of another
run, so the baseline and the policies that could be the answer run again, in ABBA order, until their run-level speeds
separate (``repeat_runs``), each run one replicate (its median step, a ``RoundBlock``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Protocol

from dtypelab.core.disturbance import was_disturbed
from dtypelab.core.objectives import objective as objective_of
from dtypelab.core.pairing import block_energy, paired_energy, paired_gain, paired_speedup
from dtypelab.core.policies import Plan
from dtypelab.core.records import save_judged
from dtypelab.core.results import PolicyResult, Report, RoundBlock, Verdict
from dtypelab.core.stats import MIN_GAIN


class Runs(Protocol):
    """What runs the script once more under a policy (``runner._Runs``)."""

    def once(self, plan: Plan, label: str = "") -> tuple[PolicyResult, Any, tuple[str, ...]]: ...


MIN_RUNS = 3  # runs per policy before their interval may decide (a t interval over two pairs spans nearly anything)
MAX_CONTENDERS = 3  # policies repeated beside the baseline: the fastest that could be the answer
ACCEPTED = frozenset({Verdict.RECOMMENDED, Verdict.BETTER, Verdict.EQUAL, Verdict.WITHIN, Verdict.NO_GAIN})


def contenders(report: Report) -> list[str]:
    """The policies that could be the answer, best first: within the constraints (metric, memory) and faster than the
    baseline by their first run's median step beyond the no-gain band (or, for the energy objective, using less
    energy per step by their first run's counter)."""
    rec = report.recommendation
    if rec is None:
        return []
    bar = 1 + MIN_GAIN
    gain = _energy_gain(report) if objective_of(report.config.objective).counts_joules else {
        v.policy: v.speedup or 0.0 for v in rec.policies}
    could = [v.policy for v in rec.policies
             if v.verdict in ACCEPTED and v.policy != report.baseline and gain.get(v.policy, 0.0) > bar]
    return sorted(could, key=lambda n: -gain[n])[:MAX_CONTENDERS]


def _energy_gain(report: Report) -> dict[str, float]:
    """Each policy's first run's joules per step against the baseline's (above 1: it uses less)."""
    base = report.base
    if base is None or base.energy is None:
        return {}
    return {r.policy: base.energy.joules_per_step / r.energy.joules_per_step for r in report.results
            if r.energy is not None and r.energy.joules_per_step > 0}


def abba(run: int, baseline: str, names: list[str]) -> list[str]:
    """The order of the ``run``-th repeat (the first runs are run 0, the baseline first): reversed every other
    time, so that a drift over the session (a CPU warming, a neighbour starting) weighs on every policy alike."""
    order = [baseline, *names]
    return order[::-1] if run % 2 else order


def _block(run: int, r: PolicyResult) -> RoundBlock:
    timed = r.step_times_s[r.warmup:]
    e = r.energy  # the run's window over its timed steps, where a counter read it
    joules = e.joules_per_step * len(timed) if e is not None else None
    return RoundBlock(round=run, median_s=statistics.median(timed), n=len(timed),
                      other_cores=float(r.disturbance.get("other_cores", 0.0) or 0.0),
                      disturbed=was_disturbed(r.disturbance), joules=joules,
                      window_s=joules / e.watts if joules is not None and e is not None and e.watts else None)


def undecided(blocks: dict[str, list[RoundBlock]], baseline: str, names: list[str], runs_done: int,
              objective: str = "speed") -> list[str]:
    """The policies whose run-level interval still straddles the no-gain band (neither measurably faster nor
    surely not): more runs could change the answer. Before ``MIN_RUNS`` every one is."""
    if runs_done < MIN_RUNS:
        return list(names)
    bar = 1 + MIN_GAIN
    out = []
    for name in names:
        ci = paired_gain(objective_of(objective), tuple(blocks[baseline]), tuple(blocks[name]))
        if ci is None or ci.low <= bar < ci.high:
            out.append(name)
    return out


def repeat_runs(report: Report, plans: dict[str, Plan], run: Runs, json_path: str | None,
                budget_s: float | None = None) -> Report:
    """Each policy ran once, in its own process: what differs between two policies' runs is also what differs
    between two runs of one (the process, the memory layout, the machine's state), which the steps of one run
    cannot show. The baseline and the contenders run again, in ABBA order, until each contender's interval over
    the runs clears the no-gain band or ``runs`` is spent; each run is one replicate (its median step), and the
    speedup is paired run by run, as a task's rounds are. The decision then follows the same rule as a task's.
    A round of repeats that would end past ``budget_s`` (what the sweep's --budget left; a run costs its first
    run's wall time) is not started, and the notes say so."""
    total, base = report.config.runs, report.baseline
    names = contenders(report)
    if total <= 1 or not names:
        return report
    blocks = {n: [_block(0, report.result(n))] for n in [base, *names]}
    left, failed, notes = list(names), {}, {}
    start = time.monotonic()
    for i in range(1, total):
        cost = sum(report.result(n).wall_s for n in [base, *left])
        if budget_s is not None and time.monotonic() - start + cost > budget_s:
            said = (f"the --budget ended the repeated runs after {i} run{'s' if i > 1 else ''} each (another round "
                    f"would take about {cost:.0f} s)")
            notes = dict.fromkeys([base, *left], said)
            break
        for name in abba(i, base, left):
            result, _, _ = run.once(plans[name], label=f"run {i + 1} of up to {total}")
            if result.status != "ok" or not result.timing:
                failed[name] = f"its run {i + 1} {result.status}: {result.reason or 'no step timed'}"
                if name == base:
                    left = []
                    break
                left.remove(name)
                continue
            blocks[name].append(_block(i, result))
        left = undecided(blocks, base, left, i + 1, report.config.objective)
        if not left:
            break
    for name, kept in blocks.items():
        r = report.result(name)
        assert r is not None  # every policy repeated ran once first
        ci = None if name == base else paired_speedup(tuple(blocks[base]), tuple(kept))
        said = tuple(n for n in (failed.get(name), notes.get(name)) if n)
        report = report.with_result(replace(r, rounds=tuple(kept), speedup_ci=ci, notes=(*r.notes, *said),
                                            **_run_energy(r, tuple(blocks[base]), tuple(kept), name == base)))
    return save_judged(report, json_path)


def _run_energy(r: PolicyResult, base: tuple[RoundBlock, ...], kept: tuple[RoundBlock, ...], is_base: bool
                ) -> dict[str, Any]:
    """Energy over the runs (each run one window, one replicate) and paired run by run with the baseline's."""
    if r.energy is None:
        return {}
    energy = block_energy(kept, r.batch_size or 1, None, r.energy.by, None)
    return {"energy": energy or r.energy, "energy_ci": None if is_base else paired_energy(base, kept)}


__all__ = ["abba", "contenders", "repeat_runs", "undecided"]
