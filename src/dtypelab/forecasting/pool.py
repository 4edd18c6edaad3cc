"""The tracing workers both forecasts share (training's ``forecast`` and serving's ``--mode generate``): how many
processes trace at once, and each part of a forecast run on a launcher of its own, followed from a thread, Ctrl-C
stopping every part in flight while what each reported stays."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dtypelab.run import Outcome, stop_in_flight

OnPart = Callable[[int, int], None]  # (the part, the steps it has done)


def worker_count(requested: int | None, parts: int) -> int:
    """Processes tracing at once: as many as asked, else one per core up to two (a trace is one thread; a third on
    two cores only slows the other two), never more than there are parts."""
    return max(1, min(parts, requested or min(2, os.cpu_count() or 1)))


def run_parts(jobs: Sequence[Any], launchers: Sequence[Any], on_part: OnPart | None = None,
              together: bool = True) -> tuple[list[Outcome], bool]:
    """Each job on its launcher; (outcomes, whether Ctrl-C stopped them). ``together``: each followed from a thread
    of its own, at once (else one after another here: tracing in this process twice at once cannot be, the dispatch
    modes a trace enters being global)."""
    def run(i: int) -> Outcome:
        def step(n: int, _total: int) -> None:
            if on_part is not None:
                on_part(i, n)

        outcome: Outcome = launchers[i].run(jobs[i], 24 * 3600, step)
        return outcome

    if not together:
        return _in_turn(run, len(jobs))
    pool = ThreadPoolExecutor(len(jobs))
    futures = [pool.submit(run, i) for i in range(len(jobs))]
    try:
        return [f.result() for f in futures], False
    except KeyboardInterrupt:  # it reaches the main thread only: stop every run in flight, keep what each reported
        stop_in_flight()
        return [f.result() for f in futures], True
    finally:
        pool.shutdown(wait=False)


def _in_turn(run: Callable[[int], Outcome], n: int) -> tuple[list[Outcome], bool]:
    out: list[Outcome] = []
    try:
        for i in range(n):
            out.append(run(i))
    except KeyboardInterrupt:
        return out, True
    return out, False


__all__ = ["run_parts", "worker_count"]
