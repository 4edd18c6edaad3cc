"""A script's policies each run in a process of their own: the run is the replicate, not the step. The baseline
and the policies that could be the answer are run again in ABBA order until their run-level intervals separate;
the baseline is fp32, the one the user names, or fp64 for a script that builds its model in float64."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import pytest
from conftest import HERE, TINY, fake_hardware

import dtypelab
from dtypelab.core.judging import judged
from dtypelab.core.policies import get_policy, policy_info
from dtypelab.core.results import Decision, PolicyResult, Report, RunConfig, Verdict
from dtypelab.core.results.bench import BENCH_VERSION
from dtypelab.core.stats import unpaired_faster
from dtypelab.script.repeats import abba, repeat_runs

FLOAT64 = os.path.join(HERE, "scripts", "float64_script.py")


def _run(policy: str, median_ms: float, seed: int, noise: float = 0.005) -> PolicyResult:
    """One run: 60 steps whose spread within the run is ``noise`` around ``median_ms``."""
    rng = random.Random(seed)
    steps = tuple(median_ms / 1000 * (1 + rng.uniform(-noise, noise)) for _ in range(60))
    return PolicyResult(policy, "ok", warmup=5, step_times_s=steps, losses=(0.5,) * 60, metrics={"accuracy": 0.9},
                        info=policy_info(get_policy(policy)), batch_size=8)


def _report(results: list[PolicyResult], runs: int) -> Report:
    config = RunConfig(task="train.py", mode="train", policies=tuple(r.policy for r in results), steps=60,
                       batch_size=8, warmup=5, seed=0, tolerance="1%", device="cpu", force=False, timeout_s=60,
                       metric="accuracy", higher_is_better=True, runs=runs)
    return judged(Report(config, {}, results=tuple(results)))


class FakeRuns:
    """The script's runs, faked: each call gives the next run-level median of that policy (ms)."""

    def __init__(self, medians: dict[str, list[float]]) -> None:
        self.medians = {k: list(v) for k, v in medians.items()}
        self.calls: list[str] = []

    def once(self, plan, label=""):
        self.calls.append(plan.name)
        return _run(plan.name, self.medians[plan.name].pop(0), seed=len(self.calls)), None, ()


PLANS = {name: get_policy(name) for name in ("fp32", "bf16", "amp-bf16")}


def test_one_run_each_is_no_speed_evidence_though_its_steps_say_faster():
    first = [_run("fp32", 60.0, 1), _run("bf16", 55.0, 2)]
    # within one run the steps are tight: a test over steps calls a 9% gap certain
    assert unpaired_faster(first[0].step_times_s[5:], first[1].step_times_s[5:])
    report = _report(first, runs=1)
    assert report.recommendation.decision == Decision.KEEP_BASELINE
    assert report.recommendation.verdict("bf16").verdict == Verdict.NO_GAIN
    assert "by one run's median step" in " ".join(report.recommendation.sentences)


def test_run_to_run_drift_larger_than_the_steps_noise_decides_nothing():
    """fp32's and bf16's runs drift by ±10% from run to run, far more than the 0.5% within a run: the gap of the
    first runs (60 vs 55 ms) is no evidence, and the repeats show it."""
    first = [_run("fp32", 60.0, 1), _run("bf16", 55.0, 2)]
    report = _report(first, runs=5)
    runs = FakeRuns({"fp32": [52.0, 66.0, 55.0, 63.0], "bf16": [62.0, 54.0, 61.0, 57.0]})
    report = repeat_runs(report, PLANS, runs, None)
    assert runs.calls == ["bf16", "fp32", "fp32", "bf16", "bf16", "fp32", "fp32", "bf16"]  # ABBA, all 5 runs
    bf16 = report.result("bf16")
    assert len(bf16.rounds) == len(report.result("fp32").rounds) == 5
    assert bf16.speedup_ci.low <= 1.02 < bf16.speedup_ci.high
    assert report.recommendation.decision == Decision.KEEP_BASELINE
    assert "fp32 5, bf16 5" in " ".join(report.recommendation.notes)  # the note says how many runs each had


def test_a_gap_that_holds_run_after_run_is_decided_at_three_runs():
    first = [_run("fp32", 60.0, 1), _run("bf16", 44.0, 2), _run("amp-bf16", 50.0, 3)]
    report = _report(first, runs=5)
    runs = FakeRuns({"fp32": [63.0, 58.0, 61.0, 60.0], "bf16": [46.0, 43.0, 45.0, 44.0],
                     "amp-bf16": [52.0, 49.0, 51.0, 50.0]})
    report = repeat_runs(report, PLANS, runs, None)
    assert runs.calls == ["amp-bf16", "bf16", "fp32", "fp32", "bf16", "amp-bf16"]  # decided after three runs
    assert report.result("bf16").speedup_ci.low > 1.02 and report.result("amp-bf16").speedup_ci.low > 1.02
    rec = report.recommendation
    assert rec.decision == Decision.USE and rec.chosen == "bf16"
    assert "over 3 paired rounds" in rec.reason


def test_only_the_policies_that_could_be_the_answer_are_repeated():
    first = [_run("fp32", 60.0, 1), _run("bf16", 40.0, 2), _run("amp-bf16", 61.0, 3)]
    first[1] = replace(first[1], metrics={"accuracy": 0.5})  # outside the tolerance: never the answer
    report = _report(first, runs=4)
    runs = FakeRuns({"fp32": [60.0] * 3, "bf16": [40.0] * 3, "amp-bf16": [61.0] * 3})
    assert repeat_runs(report, PLANS, runs, None) is report and runs.calls == []


def test_abba_reverses_every_other_repeat():
    assert abba(1, "fp32", ["a", "b"]) == ["b", "a", "fp32"]
    assert abba(2, "fp32", ["a", "b"]) == ["fp32", "a", "b"]


def test_a_named_baseline_is_what_every_ratio_and_tolerance_is_against(tmp_path):
    path = tmp_path / "r.json"
    report = dtypelab.bench(f"{TINY}:make_task", "fp32,bf16,amp-bf16", baseline="amp-bf16", launcher="inline",
                            rounds=0, steps=30, hardware=fake_hardware(), json_path=str(path))
    assert report.config.baseline == "amp-bf16" and report.baseline == "amp-bf16"
    rec = report.recommendation
    assert rec.verdict("amp-bf16").verdict == Verdict.BASELINE and rec.verdict("fp32").verdict != Verdict.BASELINE
    base = report.result("amp-bf16")
    fp32 = report.result("fp32")
    assert rec.verdict("fp32").speedup == pytest.approx(base.timing.median / fp32.timing.median)
    assert fp32.metric("accuracy") is not None and rec.verdict("fp32").delta  # its metric against amp-bf16's
    assert "may be up to 1% lower than amp-bf16's" in " ".join(rec.sentences)
    assert not any(v.text.endswith("than fp32") for v in rec.policies)
    assert dtypelab.load_record(str(path)).config.baseline == "amp-bf16"
    with pytest.raises(dtypelab.DtypelabError, match=r"^--baseline: unknown policy 'amp-bf61' \(did you mean"):
        dtypelab.bench(f"{TINY}:make_task", "fp32", baseline="amp-bf61", launcher="inline")


def test_a_record_from_before_the_baseline_was_named_is_judged_against_fp32(tmp_path):
    report = _report([_run("fp32", 60.0, 1), _run("bf16", 50.0, 2)], runs=0)
    d = report.to_dict()
    d["schema_version"] = 3
    del d["config"]["baseline"], d["config"]["runs"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    old = dtypelab.load_record(str(path))
    assert old.config.baseline == "fp32" and old.config.runs == 0 and old.schema_version == BENCH_VERSION


@pytest.mark.slow
@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_a_float64_script_is_measured_against_its_own_fp64_and_the_failing_lines_are_named():
    report = dtypelab.bench(FLOAT64, "fp32,bf16", runs=1, hardware=fake_hardware())
    assert report.config.baseline == "fp64" and report.config.policies[:2] == ("fp32", "fp64")
    fp64 = report.result("fp64")
    assert fp64.status == "ok" and any("fp64 (its own precision) is the baseline" in n for n in fp64.notes)
    fp32 = report.result("fp32")
    assert fp32.status == "failed" and "float64_script.py:20, 21" in fp32.reason and "DTL110" in fp32.reason
    assert report.recommendation.verdict("fp64").verdict == Verdict.BASELINE
    named = dtypelab.bench(FLOAT64, "fp32", baseline="fp32", runs=1, hardware=fake_hardware())
    assert named.config.baseline == "fp32" and named.recommendation.decision == Decision.NO_BASELINE


def test_the_repeats_stop_within_the_sweeps_budget():
    """A round of repeats costs each policy's first run's wall time: 90 s does not fit in the 80 s left."""
    first = [replace(_run("fp32", 60.0, 1), wall_s=50.0), replace(_run("bf16", 55.0, 2), wall_s=40.0)]
    report = _report(first, runs=5)
    runs = FakeRuns({"fp32": [52.0, 66.0], "bf16": [62.0, 54.0]})
    report = repeat_runs(report, PLANS, runs, None, budget_s=80.0)
    assert runs.calls == [] and report.recommendation.decision == Decision.KEEP_BASELINE
    said = "the --budget ended the repeated runs after 1 run each (another round would take about 90 s)"
    assert said in report.result("bf16").notes and said in report.result("fp32").notes


def test_every_place_that_means_the_baseline_names_the_records_baseline(monkeypatch):
    """--baseline names it; the CLI's error, a script's skipped policies and their verdicts say that one, not fp32."""
    from typer.testing import CliRunner

    from dtypelab.cli import app
    from dtypelab.script.runner import baseline_failed

    failed = PolicyResult("fp64", "failed", "it broke", info=policy_info(get_policy("fp64")))
    report = _report([failed], runs=0)
    report = replace(report, config=replace(report.config, baseline="fp64", policies=("fp64", "bf16")))
    skipped = judged(baseline_failed(report, {"fp64": get_policy("fp64"), "bf16": get_policy("bf16")}, failed))
    bf16 = skipped.result("bf16")
    assert bf16.skip == "baseline" and bf16.reason.startswith("not run: the fp64 baseline failed")
    verdict = skipped.recommendation.verdicts["bf16"]
    assert verdict == "not run: fp64 failed"
    monkeypatch.setattr("dtypelab.sweep.bench", lambda *a, **k: skipped)
    run = CliRunner().invoke(app, ["bench", "digits", "--baseline", "fp64", "--json", os.devnull])
    assert run.exit_code == 1
    assert "the fp64 baseline did not complete (failed: it broke)" in " ".join(run.output.split())
