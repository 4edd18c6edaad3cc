"""The serving policies' speed and energy, timed as bench times training steps (``sweep.rounds``): every policy's
model built in one process, each warmed up (a compiled one compiles there), then a block of whole generations of
each, round-robin (the order reversed every other round), so that whatever disturbs the machine hits a round's
policies alike and each policy's rounds pair with the baseline's (``core.judging.generate``). A block holds whole
generations for a quarter second (bench's passes' ``ROUND_BLOCK_S``: a short one timed warm, the median of the
block kept), and as many as span the energy counter's shortest window; the counter reads each block's joules. After
the rounds, each policy's prefill alone is read over windows too, to split a generation's joules between the
prefill and the decode."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtypelab.core.calibration import calibrating
from dtypelab.core.disturbance import CpuMeter
from dtypelab.core.energy import Meter, measuring
from dtypelab.core.executorch_lm import Generation, program_module, read_program
from dtypelab.core.loop import threads
from dtypelab.core.measure import ROUND_BLOCK_S, device_sync
from dtypelab.core.pairing import block_energy
from dtypelab.core.policies import Plan, Precision
from dtypelab.core.results import Energy, EnergySource, RoundBlock
from dtypelab.run import Reporter
from dtypelab.serving.kv import kv_format
from dtypelab.serving.measure import built, prompts
from dtypelab.serving.served import load_served
from dtypelab.serving.workload import Shape, compute_dtype, generate, new_cache, prefill

ROUNDS = 5  # the default: a paired interval needs a few rounds (3 leave a t-quantile of 4.3)
WINDOW_MARGIN = 1.25  # blocks sized for the energy counter span this much more than its shortest window
ENERGY_WINDOWS = 3  # windows of prefills the counter reads per policy, to split a generation's joules


@dataclass(frozen=True)
class Timing:
    """One policy's rounds: each block, and each round's median prefill and decode seconds; its energy."""

    blocks: tuple[RoundBlock, ...]
    ttft_runs_s: tuple[float, ...]
    decode_runs_s: tuple[float, ...]
    energy: Energy | None = None
    energy_runs: tuple[float, ...] = ()  # each round's joules per generated token


@dataclass(frozen=True)
class Timings:
    """What the rounds' process returns (typed, across the process boundary)."""

    policies: dict[str, Timing]
    energy_source: EnergySource | None


@dataclass(frozen=True)
class GenerateRounds:
    """Interleaved timing rounds of several serving policies in one process (picklable: the model travels as its
    spec). ``policies``: (the policy's name, its plan, its KV format's label)."""

    spec: str
    policies: tuple[tuple[str, Plan, str], ...]
    shape: Shape
    rounds: int
    seed: int
    device: str
    threads: int | None = None
    program: Generation | None = None  # what a program policy is exported for (as its measuring job's)
    calibration: list[list[int]] | None = None  # the token ids a calibrated policy read there, read again here
    programs: tuple[tuple[str, str], ...] = ()  # (policy, file): a program its measuring job wrote, timed as it is

    @property
    def name(self) -> str:
        return "generation rounds"

    def __call__(self, report: Reporter) -> Timings:
        with threads(self.threads):
            rounds = _Rounds(self)  # built as the measuring job builds them: a conversion may set parameters
            with torch.inference_mode():
                return rounds.run(report)


@dataclass
class _Policy:
    name: str
    model: Any
    precision: Any
    cache: Any


class _Rounds:
    def __init__(self, job: GenerateRounds) -> None:
        self.job, self.device = job, torch.device(job.device)
        self.sync: Callable[[], None] = device_sync(self.device) or (lambda: None)
        served = load_served(job.spec)
        self.runs: list[_Policy] = []
        self.ids: torch.Tensor | None = None
        for name, plan, kv in job.policies:
            model, config, precision = self._built(served, name, plan)
            with precision.session():
                dtype = compute_dtype(model, config, self.device)
            self.runs.append(_Policy(name, model, precision, new_cache(config, kv_format(kv), job.shape, dtype,
                                                                       self.device, model=model)))
            if self.ids is None:
                self.ids = prompts(served.text, job.shape).to(self.device)
        self.meter, self.source = measuring(self.device)

    def _built(self, served: Any, name: str, plan: Plan) -> tuple[Any, Any, Precision]:
        """The policy's model as its measuring job had it: the program it wrote, loaded (not lowered again), or the
        model converted again (calibrated on the same text)."""
        job = self.job
        path = dict(job.programs).get(name)
        if path is not None:
            return program_module(read_program(path)), None, Precision(plan, self.device)
        with calibrating(None if job.calibration is None else torch.tensor(job.calibration)):
            return built(served, plan, job.seed, self.device,
                         job.program or Generation(job.shape.batch_size, job.shape.context))

    def generation(self, run: _Policy) -> Any:
        assert self.ids is not None
        run.cache.reset()
        return generate(run.model, self.ids, self.job.shape.gen_len, run.cache, self.sync)

    def run(self, report: Reporter) -> Timings:
        for run in self.runs:  # a compiled policy compiles here
            with run.precision.session():
                self.generation(run)
        out: dict[str, list[tuple[RoundBlock, float, float]]] = {run.name: [] for run in self.runs}
        total = self.job.rounds * len(self.runs)
        for r in range(self.job.rounds):
            for run in self.runs if r % 2 == 0 else self.runs[::-1]:
                out[run.name].append(self._block(run, r))
                report.step(sum(map(len, out.values())), total)
        return Timings({run.name: self._timing(run, out[run.name]) for run in self.runs}, self.source)

    def _block(self, run: _Policy, r: int) -> tuple[RoundBlock, float, float]:
        """Round ``r``'s block of whole generations of one policy, timed, watched and read by the counter."""
        cpu = CpuMeter()
        with run.precision.session():
            cpu.start()
            window = self.meter.begin() if self.meter else None
            start, gens = time.perf_counter(), [self.generation(run)]
            # whole generations for ROUND_BLOCK_S (a short one timed warm, as bench's passes are), and with a counter
            # until its shortest window is spanned (by time: a pace measured beside a busy neighbour would size a
            # block too short)
            least = max(ROUND_BLOCK_S, WINDOW_MARGIN * window.meter.min_window_s if window else 0.0)
            while time.perf_counter() - start < least:
                gens.append(self.generation(run))
            reading = window.end()[0] if window else None
            d = cpu.stop()
        block = RoundBlock(round=r, median_s=statistics.median(g.ttft_s + g.decode_s for g in gens), n=len(gens),
                           other_cores=d.other_cores if d else 0.0, pressure_s=d.pressure_s if d else None,
                           disturbed=bool(d and d.disturbed), joules=reading.joules if reading else None,
                           window_s=reading.seconds if reading else None)
        return block, statistics.median(g.ttft_s for g in gens), statistics.median(g.decode_s for g in gens)

    def _timing(self, run: _Policy, rounds: list[tuple[RoundBlock, float, float]]) -> Timing:
        blocks = tuple(b for b, _, _ in rounds)
        timing = Timing(blocks, tuple(t for _, t, _ in rounds), tuple(d for _, _, d in rounds))
        if self.meter is None:
            return timing
        energy = self._energy(run, blocks, self.meter)
        if energy is None:
            return timing
        generated = self.job.shape.batch_size * self.job.shape.gen_len
        return replace(timing, energy=energy,
                       energy_runs=tuple(b.joules / b.n / generated for b in blocks if b.joules is not None))

    def _energy(self, run: _Policy, blocks: tuple[RoundBlock, ...], meter: Meter) -> Energy | None:
        """Joules per generated token over the rounds' whole generations, split by the prefill's per prompt token
        (windows of prefills alone); None where the counter could not read a window."""
        shape, source = self.job.shape, self.source
        generated, prompt = shape.batch_size * shape.gen_len, shape.batch_size * shape.prompt_len
        whole = block_energy(blocks, shape.batch_size, generated, meter.name, source.idle_watts)

        def first() -> None:
            assert self.ids is not None
            run.cache.reset()
            prefill(run.model, self.ids, run.cache)

        with run.precision.session():
            pre = block_energy(_windows(meter, first), shape.batch_size, prompt, meter.name, source.idle_watts)
        if whole is None or pre is None:
            return None
        steps = shape.batch_size * (shape.gen_len - 1)
        return replace(whole, prefill_joules_per_token=pre.joules_per_token, decode_joules_per_token=(
            (whole.joules_per_step - pre.joules_per_step) / steps if steps else None))


def _windows(meter: Meter, work: Callable[[], None]) -> tuple[RoundBlock, ...]:
    """``ENERGY_WINDOWS`` windows, each of as many whole ``work()`` calls as fill the counter's shortest window (a
    window the counter could not read is left out)."""
    out = []
    for i in range(ENERGY_WINDOWS):
        window, calls = meter.begin(), 0
        while calls == 0 or window.elapsed_s < meter.min_window_s:
            work()
            calls += 1
        reading, _ = window.end()
        if reading is not None:
            out.append(RoundBlock(round=i, median_s=reading.seconds / calls, n=calls, joules=reading.joules,
                                  window_s=reading.seconds))
    return tuple(out)


__all__ = ["ROUNDS", "GenerateRounds", "Timing", "Timings"]
