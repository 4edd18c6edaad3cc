from __future__ import annotations

import math

import pytest

from dtypelab import DtypelabError, PolicyResult, Report, RunConfig, Tolerance, recommend
from dtypelab.core.judging import judged
from dtypelab.render.bench import render_html, render_markdown


def result(name, ms, metric, status="ok", mem=100, nonfinite=None, reason=""):
    return PolicyResult(name, status, reason, batch_size=10, warmup=0, step_times_s=(ms / 1e3,) * 5 if ms else (),
                        losses=(1.0,), first_nonfinite_step=nonfinite,
                        metrics={"acc": metric} if metric is not None else {}, peak_memory_bytes=mem)


def report(*results, tolerance="1%", higher=True) -> Report:
    cfg = RunConfig(task="t", mode="train", policies=tuple(r.policy for r in results), steps=5, batch_size=10,
                    warmup=0, seed=0, tolerance=tolerance, device="cpu", force=False, timeout_s=1,
                    metric="acc", higher_is_better=higher)
    return judged(Report(cfg, {"hardware": {}}, tuple(results)))  # as a sweep writes it: with its decision


def test_tolerance_parsing():
    assert Tolerance.parse("1%") == Tolerance(0.01, True)
    assert Tolerance.parse("0.5%").allowed(0.8) == pytest.approx(0.004)
    assert Tolerance.parse("0.02") == Tolerance(0.02, False)
    for bad in ("abc", "-1%", "nan", "%", "inf"):
        with pytest.raises(DtypelabError, match="bad tolerance"):
            Tolerance.parse(bad)


def test_fastest_within_tolerance_wins_and_rejections_are_explained():
    rec = recommend(report(result("fp32", 10, 0.965), result("amp-bf16", 4, 0.962),
                           result("bf16", 3, 0.945), result("fp16", None, None, "skipped", reason="slow here")))
    assert rec.best == "amp-bf16"
    text = " ".join(rec.sentences)
    assert text.startswith("Use amp-bf16: 2.50x faster than fp32, acc 0.962 vs 0.965 (-0.31%, within 1%).")
    assert "bf16: 3.33x faster than fp32, acc 0.945 (-2.07%, outside 1%)." in text
    assert "fp16: skipped — slow here." in text
    assert rec.verdicts["bf16"] == "outside 1%"


def test_lower_is_better_metric_and_absolute_tolerance():
    rec = recommend(report(result("fp32", 10, 2.00), result("bf16", 5, 2.04), result("amp-bf16", 6, 2.01),
                           higher=False, tolerance="0.02"))
    assert rec.best == "amp-bf16"  # bf16 is faster but 0.04 bits worse than the allowed 0.02


def test_unstable_and_diverged_runs_are_never_recommended():
    rec = recommend(report(result("fp32", 10, 0.9), result("fp16", 2, 0.9, nonfinite=3),
                           result("bf16", 1, math.nan, status="diverged", nonfinite=0)))
    assert rec.best == "fp32"
    assert rec.sentences[0].startswith("Keep fp32")
    assert rec.verdicts["fp16"].startswith("non-finite loss") and rec.verdicts["bf16"].startswith("diverged")


def test_lowest_memory_is_reported_when_it_differs():
    rec = recommend(report(result("fp32", 10, 0.9, mem=100 * 2**20), result("amp-bf16", 5, 0.9, mem=90 * 2**20),
                           result("bf16", 6, 0.9, mem=50 * 2**20)))
    assert rec.best == "amp-bf16" and rec.lowest_memory == "bf16"
    assert any("Lowest peak memory within tolerance: bf16 (50 MiB vs 90 MiB" in s for s in rec.sentences)


def test_no_recommendation_without_a_baseline():
    rec = recommend(report(result("fp32", None, None, status="failed", reason="boom"), result("bf16", 5, 0.9)))
    assert rec.best is None and "baseline did not complete (failed: boom)" in rec.sentences[0]


def test_renderers_show_every_policy():
    r = report(result("fp32", 10, 0.965), result("bf16", 3, 0.945))
    md = render_markdown(r)
    assert md.count("\n| ") == 3 and "| bf16 | ok | 3 ± 0 |" in md
    html = render_html(r)
    assert "<td>bf16</td>" in html and "outside 1%" in html


def test_gradscaler_skips_are_explained():
    amp = PolicyResult("amp-fp16", "ok", batch_size=10, step_times_s=(0.005,) * 5, losses=(1.0,) * 5,
                       metrics={"acc": 0.9}, scaler={"grad_scale": [65536.0, 32768.0, 0.5], "skipped_steps": 2,
                                                     "first_skipped_step": 0})
    rec = recommend(report(result("fp32", 10, 0.9), amp))
    assert "amp-fp16: GradScaler skipped 2 of 5 steps (first at step 0), final scale 0.5." in rec.sentences
    assert any(s.startswith("amp-fp16: warning: the loss scale collapsed below 1 (step 1, minimum 0.5)")
               for s in rec.sentences)


def test_a_metric_that_moved_the_good_way_reads_better_and_the_tolerance_says_it_is_one_sided():
    rec = recommend(report(result("fp32", 10, 0.0200), result("fp64", 20, 0.0197), result("bf16", 5, 0.0201),
                           higher=False))
    text = " ".join(rec.sentences)
    assert "fp64: 2.00x slower than fp32 (0.50x its speed), acc 0.0197 (-1.50%, better than fp32)." in text
    assert rec.verdicts["fp64"] == "better than fp32" and "within" not in rec.verdicts["fp64"]
    assert rec.best == "bf16" and "(+0.50%, within 1%)" in rec.sentences[0]
    assert "Tolerance 1% is one-sided: a policy's acc may be up to 1% higher than fp32's" in text


def test_disturbed_timings_are_named_and_a_disturbed_decision_is_flagged():
    import dataclasses

    quiet = result("fp64", 20, 0.965)
    busy = dataclasses.replace(result("bf16", 4, 0.964), disturbance={"wall_s": 2.0, "other_cores": 0.96,
                                                                       "pressure_s": 0.8})
    rec = recommend(report(result("fp32", 10, 0.965), quiet, busy))
    text = " ".join(rec.sentences)
    assert rec.best == "bf16" and "Caution: the decision rests on disturbed timings." in text
    assert "bf16 (0.96 of a core, tasks waited for a CPU 40% of the time)" in text and "fp64 (" not in text
    calm = recommend(report(result("fp32", 10, 0.965), quiet))
    assert not any("Other processes" in s for s in calm.sentences)


def _paired(name, point, low, high, metric):
    """A result whose speed comes from paired rounds (its interval), with the policy's own description."""
    from dtypelab.core.policies import get_policy, policy_info
    from dtypelab.core.results import RoundBlock, SpeedupInterval

    blocks = tuple(RoundBlock(i, 0.01 / point, 10) for i in range(5))
    ci = None if name == "fp32" else SpeedupInterval(point, low, high, 5)
    return PolicyResult(name, "ok", batch_size=10, step_times_s=(0.01 / point,) * 5, losses=(1.0,),
                        metrics={"acc": metric}, peak_memory_bytes=100, rounds=blocks, speedup_ci=ci,
                        info=policy_info(get_policy(name)))


def test_among_speeds_that_cannot_be_told_apart_the_safer_numerics_win():
    """bench digits once chose pure bf16 (1.54x, 1.08–2.18) over amp-bf16 (1.44x, 1.06–1.95) at the same accuracy:
    overlapping intervals decide nothing, so the metric decides, then float32 weights."""
    fp32 = _paired("fp32", 1.0, 1.0, 1.0, 0.9833)
    same = recommend(report(fp32, _paired("bf16", 1.54, 1.08, 2.18, 0.9833), _paired("amp-bf16", 1.44, 1.06, 1.95,
                                                                                        0.9833)))
    assert same.best == "amp-bf16" and same.decision == "use"
    assert "keeps float32 weights" in " ".join(same.sentences)
    better = recommend(report(fp32, _paired("amp-bf16", 1.54, 1.08, 2.18, 0.9833), _paired("bf16", 1.44, 1.06,
                                                                                           1.95, 0.9861)))
    assert better.best == "bf16" and "its acc is better (0.9861 vs 0.9833)" in " ".join(better.sentences)
    apart = recommend(report(fp32, _paired("bf16", 3.0, 2.6, 3.4, 0.9833), _paired("amp-bf16", 1.44, 1.06, 1.95,
                                                                                      0.9861)))
    assert apart.best == "bf16" and "cannot be told apart" not in " ".join(apart.sentences)  # clearly faster


def test_a_policy_that_ran_untimed_gets_no_speed_verdict_and_no_decision():
    """A script whose steps were never timed once got 'Keep fp32: no other policy was faster' from nothing."""
    rec = recommend(report(result("fp32", 10, 0.9), result("bf16", None, 0.9)))
    assert rec.decision == "no-evidence" and rec.best is None and rec.no_evidence
    assert rec.reason.startswith("No recommendation: bf16 ran but timed no step")
    assert rec.verdicts["bf16"] == "not timed" and not any(s.startswith("Keep") for s in rec.sentences)
    base = recommend(report(result("fp32", None, 0.9), result("bf16", 5, 0.9)))
    assert base.decision == "no-evidence" and base.reason.startswith("No recommendation: fp32 ran but timed")


def test_separate_runs_decide_only_with_evidence_and_not_on_a_disturbed_baseline():
    """A training script's policies run in processes of their own: a median that beats fp32's by a few steps or by
    overlapping spreads decides nothing, and a win over a disturbed fp32 may be the disturbance's."""
    steady = [0.010, 0.011, 0.0105, 0.0102, 0.0108, 0.0101, 0.0107, 0.0103]

    def run(name, times, disturbed=False):
        return PolicyResult(name, "ok", batch_size=10, step_times_s=tuple(times), losses=(1.0,),
                            metrics={"acc": 0.9}, peak_memory_bytes=100,
                            disturbance={"disturbed": disturbed, "other_cores": 0.95 if disturbed else 0.0,
                                         "wall_s": 1.0})

    clear = recommend(report(run("fp32", steady), run("bf16", [t * 0.7 for t in steady])))
    assert clear.decision == "use" and clear.best == "bf16"
    few = recommend(report(run("fp32", steady[:2]), run("bf16", [t * 0.7 for t in steady[:2]])))
    assert few.decision == "keep-baseline" and few.verdicts["bf16"] == "no measurable gain"
    assert "Not measurably faster than fp32" in " ".join(few.sentences)
    # its median 4.5% below fp32's, its spread wide across fp32's (Mann-Whitney p = 0.23)
    spread = [0.008, 0.012, 0.0095, 0.0115, 0.0096, 0.0112, 0.0099, 0.0100]
    overlapping = recommend(report(run("fp32", steady), run("bf16", spread)))
    assert overlapping.decision == "keep-baseline" and overlapping.verdicts["bf16"] == "no measurable gain"
    busy = recommend(report(run("fp32", steady, disturbed=True), run("bf16", [t * 0.7 for t in steady])))
    assert busy.decision == "too-busy" and busy.best is None
    slowed_winner = recommend(report(run("fp32", steady), run("bf16", [t * 0.7 for t in steady], disturbed=True)))
    assert slowed_winner.best == "bf16"  # disturbance only slowed the winner: quiet, it wins by more
    assert busy.reason.startswith("No recommendation: the machine was too busy to decide (other processes used the "
                                  "CPU while fp32's steps were timed: 0.95 of a core")
