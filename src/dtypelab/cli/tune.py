"""tune: the fastest per-layer plan that keeps the outputs (infer) or the metric (train) close to fp32's."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from dtypelab.cli._common import app, emit, err, guarded, out
from dtypelab.cli._options import argument, command
from dtypelab.tuning import TuneOptions


@contextlib.contextmanager
def _said(label: str) -> Iterator[Callable[[str], None]]:
    """Progress text: a spinner's line on a terminal; in a log, a line per step with the seconds since the start
    (a search can take minutes)."""
    if err.is_terminal:
        with err.status(label) as status:
            yield lambda text: status.update(text)
        return
    start = time.monotonic()

    def say(text: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - start:6.0f} s] {text}\n")
        sys.stderr.flush()

    yield say  # (no line before the first step: a user mistake found first stays one line)


def _tune(opts: TuneOptions, cli: dict[str, Any]) -> None:
    from dtypelab.tuning import tune

    with guarded(), _said(f"tuning {cli['task']}") as say:
        report = tune(cli["task"], opts, progress=say)
    emit(report, "table")
    if opts.output and opts.mode == "generate":
        out.print(f"plan written to {opts.output}: dtypelab export {cli['task']} -p {opts.output} -o DIR writes it as "
                  "a compressed-tensors checkpoint (transformers and vLLM load it)", highlight=False, markup=False)
    elif opts.output:
        out.print(f"plan written to {opts.output}: dtypelab bench {report.config.task} --mode {opts.mode} -p "
                  f"fp32,{opts.output}", highlight=False, markup=False)


command(app, "tune", TuneOptions, _tune, arguments=[argument("task", str, "built-in name, path/file.py:make_task or "
                                                                       "pkg.module:make_task")],
        help="Per layer, choose a candidate config or fp32 so that the model is as fast as measured possible while it "
             "keeps the constraint: inference, the worst output cosine vs fp32 at or above --min-cosine; training, "
             "the task's metric within --tolerance of fp32's after the same training. Every plan reported was "
             "measured end to end, and one is chosen only when it is measurably faster (its 95% interval above "
             "1.02x).")
