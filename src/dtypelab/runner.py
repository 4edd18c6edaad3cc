"""Runs each policy in its own child process and streams results to disk as each one finishes."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from .results import PolicyResult
from .worker import Job, run_job

# Spawn, not fork: a forked child would inherit the parent's OpenMP/CUDA state, which is unsafe.
_CTX = mp.get_context("spawn")
_PROGRESS_EVERY_S = 0.1


@dataclass(frozen=True)
class Event:
    """Progress of a sweep, for progress bars: kind is 'start', 'step' or 'done'."""

    kind: str
    policy: str
    done: int = 0
    total: int = 0
    result: PolicyResult | None = None
    label: str = ""


OnEvent = Callable[[Event], None]


def _child(job: Job, q: mp.Queue) -> None:
    # The parent handles Ctrl-C (it terminates us); a KeyboardInterrupt traceback here is just noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= _PROGRESS_EVERY_S or done == total:
            last = now
            q.put(("step", done, total))

    q.put(("result", run_job(job, progress)))


def _death_reason(exitcode: int | None) -> tuple[str, str]:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        if sig == "SIGKILL":
            return "oom", "child killed by SIGKILL (most likely out of memory)"
        return "failed", f"child died from {sig}"
    return "failed", f"child exited with code {exitcode} before reporting a result"


def run_isolated(job: Job, timeout_s: float, on_step: Callable[[int, int], None]) -> PolicyResult:
    """Run a job in a fresh process; a crash, hang or OOM becomes a result with its reason."""
    q: mp.Queue = _CTX.Queue()
    proc = _CTX.Process(target=_child, args=(job, q), daemon=True)
    start = time.monotonic()
    proc.start()
    result: PolicyResult | None = None
    try:
        while result is None:
            try:
                msg = q.get(timeout=0.05)
            except queue.Empty:
                if not proc.is_alive():
                    try:  # it may have put its result just before exiting
                        msg = q.get(timeout=0.5)
                    except queue.Empty:
                        status, reason = _death_reason(proc.exitcode)
                        result = PolicyResult(job.policy, status, reason)
                        break
                elif time.monotonic() - start > timeout_s:
                    result = PolicyResult(job.policy, "timeout", f"stopped after the {timeout_s:g} s time limit")
                    break
                else:
                    continue
            if msg[0] == "step":
                on_step(msg[1], msg[2])
            else:
                result = msg[1]
    finally:
        if proc.is_alive():
            proc.join(timeout=2 if result is not None and result.status not in ("timeout",) else 0)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        q.close()
    if result.wall_s == 0.0:
        result = PolicyResult(**{**result.__dict__, "wall_s": time.monotonic() - start})
    return result


def run_inline(job: Job, timeout_s: float, on_step: Callable[[int, int], None]) -> PolicyResult:
    """Same job in this process (for debugging and fast tests); no crash or time-limit isolation."""
    return run_job(job, on_step)
