"""A pytest plugin: how long the garbage collector ran during a test session, explicit ``gc.collect()`` calls apart,
and which callers paid most. It is how the suite's collections were found (149 s of one full run before
``core.measure.young_heap``).

    PYTHONPATH=benchmarks pytest -p gc_time [pytest arguments]
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

_collect = gc.collect
_by_caller: dict[str, float] = {}
_total = {"explicit_s": 0.0, "explicit_n": 0, "all_s": 0.0, "all_n": 0}
_started = [0.0]


def _timed_collect(*args: Any, **kwargs: Any) -> int:
    start = time.perf_counter()
    try:
        return _collect(*args, **kwargs)
    finally:
        spent = time.perf_counter() - start
        _total["explicit_s"] += spent
        _total["explicit_n"] += 1
        frame = sys._getframe(1)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        _by_caller[where] = _by_caller.get(where, 0.0) + spent


def _every(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _total["all_s"] += time.perf_counter() - _started[0]
        _total["all_n"] += 1


gc.collect = _timed_collect
gc.callbacks.append(_every)


def pytest_sessionfinish(session: Any) -> None:
    sys.stderr.write(f"\ngc: {_total['explicit_s']:.1f} s in {_total['explicit_n']} gc.collect() calls; "
                     f"{_total['all_s']:.1f} s in all {_total['all_n']} collections\n")
    for where, spent in sorted(_by_caller.items(), key=lambda kv: -kv[1])[:10]:
        sys.stderr.write(f"{spent:8.2f} s  {where}\n")
