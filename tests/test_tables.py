"""Terminal tables stay readable at any width: every line fits, no column is narrower than the longest word of its
cells (so rich wraps between words, never inside one), and a column that has to go is named below the table.
Checked at 80, 120 and 200 columns for every kind of table: bench training and inference, per layer, distributed,
tune, audit, trace and profile."""

from __future__ import annotations

import io
import os
import re

import pytest
from conftest import TINY, fake_hardware
from rich.console import Console

import dtypelab
from dtypelab.core.judging import judged
from dtypelab.core.records import load_record
from dtypelab.core.results import DistStats, PolicyResult, Report, RunConfig
from dtypelab.distributed.scaling import parse_links, with_scaling
from dtypelab.numerics.tables import formats_doc
from dtypelab.render.bench import render_table, sections, table_rows
from dtypelab.render.numeric import audit_doc, emit
from dtypelab.render.tables import WORD_CAP, fit_columns
from dtypelab.render.trace import trace_doc
from dtypelab.render.tune import tune_doc

V1 = os.path.join(os.path.dirname(__file__), "data", "v1")
WIDTHS = (80, 120, 200)


def _distributed() -> Report:
    cfg = RunConfig("t", "train", ("fp32", "fp32+ddp-fp16"), 10, 8, 1, 0, "1%", "cpu", False, 60, "acc", True,
                    nproc=2, link_gbps=(25.0, 100.0, 256.0, 3600.0))

    def result(name: str, compute: float, payload: int, step: float) -> PolicyResult:
        d = DistStats(2, 1, "gloo", "ddp", name, {"all_reduce": payload}, payload, 1, 0.0, compute, (1, 1),
                      (step, step), 1e-4, 10.0, 8 << 20)
        return PolicyResult(name, "ok", step_times_s=(step,) * 5, distributed=d, metrics={"acc": 1.0},
                            batch_size=8, peak_memory_bytes=1 << 20)

    report = Report(cfg, {}, (result("fp32", 0.010, 4 << 20, 0.02), result("fp32+ddp-fp16", 0.060, 2 << 20, 0.07)))
    return judged(with_scaling(report, parse_links("25gbe,100gbe,pcie4,nvlink4")))


@pytest.fixture(scope="module")
def records() -> dict[str, object]:
    out: dict[str, object] = {name: load_record(os.path.join(V1, f"{name}.json"))
                              for name in ("bench_train", "bench_infer", "audit", "trace")}
    out["distributed"] = _distributed()
    out["profile"] = dtypelab.bench(f"{TINY}:make_task", "fp32,bf16", steps=12, warmup=2, rounds=0, budget=0,
                                    profile=3, launcher="inline", hardware=fake_hardware())
    out["tune"] = dtypelab.tune(f"{TINY}:make_task", candidates="int8-dyn,bf16", min_cosine=0.9,
                                hardware=fake_hardware(int8=250.0))
    return out


def _render(record: object, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
    if isinstance(record, Report):
        render_table(record, console)
    elif isinstance(record, dtypelab.AuditReport):
        doc, styles, wrap = audit_doc(record, 0)
        emit(doc, "table", console, styles, wrap)
    elif isinstance(record, dtypelab.TraceReport):
        emit(trace_doc(record), "table", console, wrap={1})
    else:
        emit(tune_doc(record), "table", console, wrap={5})
    return console.file.getvalue()


def _column_widths(text: str) -> list[list[int]]:
    """The column widths of every table in the output, from their top borders."""
    return [[len(seg) - 2 for seg in re.split("[┳┬]", line.strip()[1:-1])] for line in text.splitlines()
            if line.startswith(("┏", "┌"))]


@pytest.mark.parametrize("kind", ["bench_train", "bench_infer", "distributed", "tune", "audit", "trace", "profile"])
@pytest.mark.parametrize("width", WIDTHS)
def test_every_table_fits_its_width_without_breaking_words(records, kind, width):
    text = _render(records[kind], width)
    assert max(map(len, text.splitlines())) <= width
    tables = _column_widths(text)
    assert tables
    if kind in ("bench_train", "bench_infer"):
        assert "dropped" not in text and "verdict" in text  # the verdict column is never the one that goes
    if width == 200 and kind in ("bench_train", "bench_infer", "trace", "tune"):
        assert "left out to fit" not in text  # a 200-column log shows these tables whole
    if "left out to fit" in text:
        assert f"left out to fit {width} columns:" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_the_bench_table_keeps_the_decision_columns_longest(records, width):
    report = records["bench_infer"]
    rec = dtypelab.recommend(report)
    headers, rows = table_rows(report, rec)
    from dtypelab.render.bench import DROP_FIRST
    from dtypelab.render.tables import drop_order

    kept, widths = fit_columns(headers, rows, width, {len(headers) - 1}, drop_order(headers, DROP_FIRST))
    shown = [headers[i] for i in kept]
    assert {"policy", "speedup", "verdict"} <= set(shown) and "accuracy ↑" in shown
    for i, w in zip(kept, widths, strict=True):  # every column at least as wide as its longest word
        longest = max(len(word) for cell in [headers[i], *(r[i] for r in rows)] for word in str(cell).split())
        assert w >= min(longest, WORD_CAP)


def test_fit_columns_drops_in_order_and_widens_text_before_wrapping_it():
    headers = ["name", "a number", "another", "why"]
    rows = [["x", "1.234", "5,678", "a reason that is long enough to wrap somewhere"]]
    kept, widths = fit_columns(headers, rows, 200, {3}, [1, 2])
    assert kept == [0, 1, 2, 3] and widths[-1] == len(rows[0][3])  # room for everything: nothing wraps
    kept, _ = fit_columns(headers, rows, 30, {3}, [2, 1])
    assert kept in ([0, 3], [0, 1, 3]) and 2 not in kept  # the first to go went first


def test_sections_and_formats_tables_fit_too(records):
    for width in WIDTHS:
        console = Console(width=width, file=io.StringIO(), force_terminal=False, color_system=None)
        emit(formats_doc(list(dtypelab.formats().values()), None), "table", console)
        assert max(map(len, console.file.getvalue().splitlines())) <= width
    assert sections(records["bench_infer"])  # the per-layer table rendered above is a section
