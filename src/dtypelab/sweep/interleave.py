"""The speed phase of a sweep: the policies that ran to the end timed again in interleaved rounds, in one process,
each given its paired speedup and interval (``rounds`` runs them)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dtypelab.core.energy import counter_of
from dtypelab.core.objectives import objective
from dtypelab.core.pairing import block_energy, paired_energy
from dtypelab.core.policies import COMPILED_BASELINE, Plan
from dtypelab.core.records import save_judged
from dtypelab.core.results import EnergySource, Report, RoundBlock
from dtypelab.run import Event, Launcher, OnEvent
from dtypelab.sweep.options import BenchOptions
from dtypelab.sweep.rounds import RoundsJob, RoundsResult, clearly_slower, paired_speedup, round_block


def interleaved(launcher: Launcher, plans: dict[str, Plan], opts: BenchOptions, on_event: OnEvent, report: Report,
                job: RoundsJob) -> Report:
    """The speed phase: the policies that ran to the end are timed again in interleaved rounds, in one process,
    and each gets its paired speedup and interval. A failure here keeps the learning runs' own timings."""
    ran = [r.policy for r in report.results if r.status == "ok" and r.timing]
    # A policy already outside the constraints is rejected whatever its speed: timing it again decides nothing. For
    # --objective energy, where a counter reads the rounds' windows, every policy that ran is timed: a slower one may
    # still spend less, and its joules are the evidence.
    counter, no_counter = counter_of(torch.device(job.device))
    every = bool(counter) and objective(report.config.objective).counts_joules
    if not counter:  # the record says why it holds no energy, whatever the rounds do
        report = replace(report, energy_source=EnergySource(why=no_counter))
    rec = report.recommendation
    slower = set() if every else clearly_slower(report, ran)
    for name in slower:
        report = report.with_result(replace(report.result(name), rounds_skip="slower"))
    names = [n for n in ran if n not in slower and (every or not (rec and (v := rec.verdict(n)) and v.verdict.settled))]
    if COMPILED_BASELINE in ran and COMPILED_BASELINE not in names and any(plans[n].compiles for n in names):
        names.append(COMPILED_BASELINE)  # the fair baseline of the compiled policies still timed
    if report.baseline not in names or (len(names) < 2 and not every):
        return save_judged(report, opts.json_path)
    job = replace(job, plans=tuple(plans[n] for n in names), baseline=report.baseline)
    block = round_block(report, job)
    if block != job.block:
        job = replace(job, block=block, warmup=1)
        report = replace(report, config=replace(report.config, rounds_block=block))
    if rec and rec.reason:  # a first answer now; the rounds confirm or refine it
        on_event(Event("notice", "", label=f"Provisional, from each run's own timing: {rec.reason}"))
    label = f"timing in {job.rounds} interleaved rounds of {job.block} step{'s' if job.block > 1 else ''}"
    on_event(Event("start", "rounds", 0, job.rounds * len(names), label=label))
    out = launcher.run(job, opts.timeout_s, lambda d, t: on_event(Event("step", "rounds", d, t)))
    result = out.value if out.ok and isinstance(out.value, RoundsResult) else RoundsResult(
        out.status if not out.ok else "failed", out.reason, wall_s=out.wall_s)
    on_event(Event("end", "rounds", result=result, label=label))
    if out.where:
        report = replace(report, rounds_on=out.where)
    if result.status != "ok" or not result.blocks:
        on_event(Event("notice", "", label=f"interleaved timing gave no rounds ({result.status}"
                                            f"{': ' + result.reason if result.reason else ''}); speeds come "
                                            "from each policy's own run"))
        return report
    if result.block and result.block != job.block:  # longer blocks for the energy counter's windows
        report = replace(report, config=replace(report.config, rounds_block=result.block))
    report = replace(report, energy_source=result.energy or report.energy_source)
    base, compiled = result.blocks[report.baseline], result.blocks.get(COMPILED_BASELINE)
    for name in names:
        r = report.result(name)
        blocks = result.blocks.get(name, ())
        fair = paired_speedup(compiled, blocks) if compiled and plans[name].compiles and \
            name != COMPILED_BASELINE else None
        ci = None if name == report.baseline else paired_speedup(base, blocks)
        report = report.with_result(replace(r, rounds=blocks, compiled_ci=fair, speedup_ci=ci,
                                            rounds_first_call_s=(result.first_call_s or {}).get(name),
                                            **_energy(report, result, name, base, blocks)))
    source = result.energy
    if source and source.counter and not any(r.energy for r in report.results):
        report = replace(report, energy_source=replace(source, why=(
            f"no block of the rounds lasted the {source.counter} counter's shortest window "
            f"({source.min_window_s:g} s)")))
    return save_judged(report, opts.json_path)


def _energy(report: Report, result: RoundsResult, name: str, base: tuple[RoundBlock, ...],
            blocks: tuple[RoundBlock, ...]) -> dict[str, Any]:
    """A policy's ``energy`` and ``energy_ci`` from its blocks' windows, where the counter measured them."""
    source = result.energy
    if source is None or not source.counter:
        return {}
    energy = block_energy(blocks, report.config.batch_size, result.tokens_per_step, source.counter,
                          source.idle_watts)
    ci = None if name == report.baseline else paired_energy(base, blocks)
    return {"energy": energy, "energy_ci": ci}
