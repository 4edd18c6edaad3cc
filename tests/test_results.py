from __future__ import annotations

import json
import math

import pytest

from dtypelab import DtypelabError, PolicyResult, Report, RunConfig, load_report
from dtypelab.core.judging import judged


def make_report() -> Report:
    cfg = RunConfig(task="digits", mode="train", policies=("fp32", "fp16"), steps=4, batch_size=8, warmup=1,
                    seed=0, tolerance="1%", device="cpu", force=False, timeout_s=60.0, metric="accuracy",
                    higher_is_better=True)
    ok = PolicyResult("fp32", "ok", batch_size=8, warmup=1, step_times_s=(0.2, 0.1, 0.1, 0.12),
                      losses=(2.0, 1.5, 1.0, 0.5), metrics={"accuracy": 0.9}, peak_memory_bytes=1000,
                      model_bytes=500, init_fingerprint="abc", scaler={"grad_scale": [65536.0]})
    bad = PolicyResult("fp16", "diverged", "loss non-finite from step 1", batch_size=8, warmup=1,
                       step_times_s=(0.3, 0.2, 0.2, 0.2), losses=(2.0, math.nan, math.inf, -math.inf),
                       first_nonfinite_step=1, metrics={"accuracy": math.nan})
    return judged(Report(cfg, {"torch": "x", "hardware": {"device": "cpu"}}, (ok, bad), created="now"))


def test_json_round_trip_is_exact_including_nonfinite():
    report = make_report()
    text = report.to_json()
    json.loads(text)  # strict JSON: no bare NaN/Infinity tokens
    assert "NaN" in text and ": NaN" not in text
    back = Report.from_json(text)
    assert back.config == report.config
    assert back.results[0] == report.results[0]
    b, r = back.results[1], report.results[1]
    assert math.isnan(b.losses[1]) and b.losses[2:] == (math.inf, -math.inf)
    assert math.isnan(b.metrics["accuracy"]) and b.first_nonfinite_step == r.first_nonfinite_step
    assert back.to_json() == text


def test_derived_statistics_exclude_warmup():
    r = make_report().results[0]
    assert r.timing.n == 3 and r.timing.median == pytest.approx(0.1)
    assert r.throughput == pytest.approx(80.0)
    assert r.final_loss == 0.5


def test_records_are_frozen_and_with_result_replaces():
    report = make_report()
    with pytest.raises(AttributeError):
        report.results = ()
    new = report.with_result(PolicyResult("fp16", "failed", "x"))
    assert report.result("fp16").status == "diverged" and new.result("fp16").status == "failed"


def test_save_is_atomic_and_load_reports_clear_errors(tmp_path):
    path = tmp_path / "out.json"
    make_report().save(str(path))
    assert load_report(str(path)).to_json() == Report.from_json(path.read_text()).to_json()  # NaN != NaN
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(DtypelabError, match="no such result file"):
        load_report(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DtypelabError, match="not valid JSON"):
        load_report(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(DtypelabError, match="not a dtypelab result"):
        load_report(str(tmp_path / "other.json"))
    d = make_report().to_dict()
    d["schema_version"] = 99
    (tmp_path / "future.json").write_text(json.dumps(d))
    with pytest.raises(DtypelabError, match="schema version 99"):
        load_report(str(tmp_path / "future.json"))


def test_rich_tables_print_user_strings_verbatim():
    """Cells, titles and notes are text, never rich markup: code and layer names keep their brackets."""
    import io

    from rich.console import Console

    from dtypelab.render.tables import rich_table

    console = Console(file=io.StringIO(), width=200)
    rich_table(console, "task [v2]", ["layer", "code"], [["blocks[0]", "torch.cat([x, x.pow(2)], dim=-1)"],
                                                        ["[bold]x[/bold]", "[red]"]], ["note [b]kept[/b]"])
    text = console.file.getvalue()
    for s in ("task [v2]", "blocks[0]", "torch.cat([x, x.pow(2)], dim=-1)", "[bold]x[/bold]", "[red]",
              "note [b]kept[/b]"):
        assert s in text, s
