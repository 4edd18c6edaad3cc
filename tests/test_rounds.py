"""Interleaved timing: paired speedups with intervals, disturbed rounds left out, decisions from confidence."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY, fake_hardware

from dtypelab import PolicyResult, Report, RunConfig, bench, recommend
from dtypelab.core.policies import get_policy
from dtypelab.core.results import RoundBlock
from dtypelab.run import Outcome
from dtypelab.sweep.rounds import RoundsJob, paired_speedup, run_rounds


def blocks(medians, disturbed=(), other=0.96):
    return tuple(RoundBlock(round=i, median_s=m, n=20, other_cores=other if i in disturbed else 0.0,
                            disturbed=i in disturbed) for i, m in enumerate(medians))


def test_paired_speedup_is_the_geometric_mean_with_a_t_interval():
    base = blocks([10.0, 10.0, 10.0, 10.0])
    ci = paired_speedup(base, blocks([5.0, 5.0, 5.0, 5.0]))
    assert ci.point == pytest.approx(2.0) and ci.low == pytest.approx(2.0) and ci.rounds == 4
    noisy = paired_speedup(base, blocks([9.0, 11.0, 9.5, 10.5]))
    assert noisy.low < 1.0 < noisy.high and noisy.point == pytest.approx(1.0, abs=0.02)
    assert paired_speedup(base[:1], blocks([5.0])) is None  # one pair: no interval


def test_a_disturbance_in_one_policys_blocks_does_not_flip_the_decision():
    """fp64 is 2x slower than fp32; another process hits three of fp32's eight blocks (10x slower there). From
    medians over all blocks fp64 could look faster; paired rounds without the disturbed ones keep 'Keep fp32'."""
    fp32 = [10.0] * 8
    hit = [1, 4, 6]
    for i in hit:
        fp32[i] = 100.0
    base, slow = blocks(fp32, hit), blocks([20.0] * 8)
    ci = paired_speedup(base, slow)
    assert ci.rounds == 5 and ci.dropped == 3 and ci.point == pytest.approx(0.5)
    rec = recommend(_report(base, ("fp64", slow, ci, 0.965)))
    assert rec.best == "fp32" and rec.sentences[0].startswith("Keep fp32")
    assert "other processes used 96% of a core during 3 of 8 fp32 blocks" in " ".join(rec.sentences)


def test_overlapping_intervals_give_no_measurable_difference():
    base = blocks([10.0, 10.0, 10.0, 10.0, 10.0])
    close = blocks([9.0, 10.5, 9.2, 10.8, 9.6])
    ci = paired_speedup(base, close)
    assert ci.low < 1.02 < ci.high
    rec = recommend(_report(base, ("bf16", close, ci, 0.965)))
    text = " ".join(rec.sentences)
    assert rec.best == "fp32" and "No measurable speed difference from fp32: bf16" in text
    assert rec.verdicts["bf16"] == "no measurable gain"


def test_a_clear_gain_is_recommended_with_its_interval():
    base = blocks([10.0, 10.2, 9.9, 10.1, 10.0])
    fast = blocks([5.0, 5.1, 4.9, 5.0, 5.05])
    rec = recommend(_report(base, ("amp-bf16", fast, paired_speedup(base, fast), 0.964)))
    assert rec.best == "amp-bf16" and "95% interval" in rec.sentences[0] and "over 5 paired rounds" in rec.sentences[0]


def test_too_disturbed_to_decide_is_said_and_flagged():
    base = blocks([30.0] * 6, disturbed=(0, 1, 2, 3))
    fast = blocks([5.0] * 6)
    rec = recommend(_report(base, ("bf16", fast, paired_speedup(base, fast), 0.965)))
    assert rec.undecided and rec.best is None and rec.sentences[0].startswith("No recommendation: the machine was too")
    assert "bf16 might be faster on a quiet machine" in rec.sentences[0]


def test_a_busy_machine_still_keeps_fp32_when_every_alternative_is_measurably_slower():
    """A bursty hog beside `bench -p fp32,fp64`: fp64's whole interval lies below 1 even so. Whatever the
    disturbance, fp64 cannot win: 'keep fp32' is safe to say, with the disturbance named; nothing is withheld."""
    base = blocks([10.0, 30.0, 12.0, 25.0, 10.0, 28.0], disturbed=(1, 3, 4, 5))
    slow = blocks([40.0, 70.0, 35.0, 60.0, 45.0, 80.0], disturbed=(1, 3, 4, 5))
    ci = paired_speedup(base, slow)
    assert ci.high < 1.0
    rec = recommend(_report(base, ("fp64", slow, ci, 0.965)))
    assert rec.best == "fp32" and not rec.undecided
    assert rec.sentences[0].startswith("Keep fp32: the machine was busy (other processes used 96% of a core during 4 "
                                       "of 6 fp32 blocks), but no alternative")


def _report(base_blocks, *others) -> Report:
    def result(name, blocks, ci, metric):
        return PolicyResult(name, "ok", batch_size=8, warmup=0, step_times_s=(blocks[0].median_s,) * 3, losses=(1.0,),
                            metrics={"acc": metric}, peak_memory_bytes=100, rounds=blocks, speedup_ci=ci)
    results = [result("fp32", base_blocks, None, 0.965), *(result(*o) for o in others)]
    cfg = RunConfig(task="t", mode="train", policies=tuple(r.policy for r in results), steps=5, batch_size=8,
                    warmup=0, seed=0, tolerance="1%", device="cpu", force=False, timeout_s=1, metric="acc",
                    higher_is_better=True, rounds=len(base_blocks), rounds_block=20)
    return Report(cfg, {"hardware": {}}, tuple(results))


def test_rounds_run_every_policy_round_robin_in_one_process(tmp_path):
    job = RoundsJob(f"{TINY}:make_task", (get_policy("fp32"), get_policy("bf16"), get_policy("amp-bf16")), "train",
                    rounds=3, block=4, batch_size=8, seed=0, device="cpu", weights=None)
    seen = []
    result = run_rounds(job, lambda done, total: seen.append((done, total)))
    assert result.status == "ok", result.reason
    assert set(result.blocks) == {"fp32", "bf16", "amp-bf16"} and all(len(b) == 3 for b in result.blocks.values())
    assert all(b.n == 4 and b.median_s > 0 for bs in result.blocks.values() for b in bs)
    assert seen[-1] == (9, 9)
    infer = run_rounds(dataclasses.replace(job, mode="infer", plans=(get_policy("fp32"), get_policy("int8-dyn"))))
    assert infer.status == "ok" and len(infer.blocks["int8-dyn"]) == 3


@pytest.fixture
def every_policy_in_rounds(monkeypatch):
    """On a tiny model a policy's own run may well be clearly slower than fp32's (per-op overhead): these tests are
    about the rounds themselves, so none is left out of them."""
    monkeypatch.setattr("dtypelab.sweep.rounds.CLEARLY_SLOWER", 0.0)


def test_the_sweep_times_in_rounds_and_stores_intervals(tmp_path, every_policy_in_rounds):
    events = []
    report = bench(f"{TINY}:make_task", "bf16,fp64", steps=20, rounds=3, isolate=False, hardware=fake_hardware(),
                   json_path=str(tmp_path / "r.json"), on_event=events.append)
    assert report.config.rounds == 3 and report.config.rounds_block == 5
    # a first answer from the runs' own timing, said before the rounds start
    said = [(e.kind, e.policy, e.label) for e in events if e.label.startswith("Provisional") or e.policy == "rounds"]
    assert said[0][0] == "notice" and said[0][2].startswith("Provisional, from each run's own timing: ")
    assert said[1][:2] == ("start", "rounds")
    for name in ("bf16", "fp64"):
        r = report.result(name)
        # 3 rounds, and up to 9 where the interval still reached below the 1.02x band, its point above it
        assert 3 <= len(r.rounds) <= 9 and r.speedup_ci and r.speedup_ci.low <= r.speedup_ci.point <= r.speedup_ci.high
    fp32 = report.result("fp32")
    assert len(fp32.rounds) == max(len(report.result(n).rounds) for n in ("bf16", "fp64")) and fp32.speedup_ci is None
    off = bench(f"{TINY}:make_task", "bf16", steps=20, rounds=0, isolate=False, hardware=fake_hardware())
    assert not off.result("bf16").rounds and off.result("bf16").speedup_ci is None
    import re

    from dtypelab.render.bench import render_markdown

    md = render_markdown(report)
    assert "speedup (95% interval)" in md and re.search(r"\| bf16 \| ok \| [^|]+ \| [\d.]+x \([\d.]+–[\d.]+\)", md)
    assert re.search(r"over 3 interleaved rounds( \(up to \d for a policy whose interval [^)]*\))? of 5 steps", md)
    from dtypelab.core.records import load_report

    again = load_report(str(tmp_path / "r.json"))
    assert again.result("bf16").speedup_ci == report.result("bf16").speedup_ci



def test_a_policy_its_own_run_put_clearly_below_fp32_is_not_timed_in_the_rounds(tmp_path, monkeypatch):
    from dtypelab.core.records import load_report
    from dtypelab.sweep.rounds import clearly_slower as _clearly_slower

    def own(name, step_s, disturbed=False):
        return PolicyResult(name, "ok", warmup=0, step_times_s=(step_s,) * 4, disturbance={"disturbed": disturbed})

    cfg = RunConfig(task="t", mode="infer", policies=("fp32", "a", "b", "c", "fp32+compile"), steps=5, batch_size=8,
                    warmup=0, seed=0, tolerance="1%", device="cpu", force=False, timeout_s=1,
                    metric="acc", higher_is_better=True)
    report = Report(cfg, {"hardware": {}}, (own("fp32", 1.0), own("a", 2.0), own("b", 1.5), own("c", 3.0, True),
                                              own("fp32+compile", 3.0)))
    # a: 0.5x, clearly slower; b: 0.67x, within a process-to-process spread of 1.02: the rounds decide; c: disturbed
    assert _clearly_slower(report, ["fp32", "a", "b", "c", "fp32+compile"]) == {"a"}
    noisy = report.with_result(own("fp32", 1.0, disturbed=True))
    assert _clearly_slower(noisy, ["fp32", "a", "b"]) == set()  # a disturbed fp32 is no yardstick
    # every policy clearly slower: the rounds have nothing to time; the record says why there is no interval (the
    # runs judged undisturbed, as on a quiet machine: a disturbed fp32 is tested above, and a test running beside
    # this one under pytest -n would disturb it)
    monkeypatch.setattr("dtypelab.sweep.rounds.CLEARLY_SLOWER", 1e9)
    monkeypatch.setattr("dtypelab.sweep.rounds.was_disturbed", lambda d: False)
    swept = bench(f"{TINY}:make_task", "bf16,fp64", steps=20, rounds=3, isolate=False, hardware=fake_hardware(),
                  json_path=str(tmp_path / "r.json"))
    for name in ("bf16", "fp64"):
        r = swept.result(name)
        assert not r.rounds and r.speedup_ci is None and r.rounds_skip == "slower"
        assert load_report(str(tmp_path / "r.json")).result(name).rounds_skip == "slower"
    assert any(n.startswith("bf16, fp64: not timed in the rounds (its own run and fp32's, both undisturbed")
               for n in swept.recommendation.notes)


def test_more_rounds_go_only_to_a_policy_the_decision_could_still_go_either_way_for():
    from dtypelab.sweep.rounds import _undecided

    out = {"fp32": list(blocks([10.0, 10.0, 10.0])), "slower": list(blocks([20.0, 21.0, 19.0])),
           "close": list(blocks([9.0, 10.5, 9.6])), "level": list(blocks([10.6, 9.4, 10.3]))}
    # "level" straddles 1.02 too, but its point is below it: more rounds narrow it around ~0.99, never above 1.02
    assert _undecided(out, "fp32") == {"close"}
    # a policy already measurably 2x faster beats "close" outright: its rounds decide nothing more
    assert _undecided({**out, "clear": list(blocks([5.0, 5.1, 4.9]))}, "fp32") == set()
    # a policy decided after 3 rounds pairs its 3 blocks with fp32's first 3 of 6, by round number
    base = blocks([10.0, 10.0, 10.0, 40.0, 40.0, 40.0])
    ci = paired_speedup(base, blocks([5.0, 5.0, 5.0]))
    assert ci.rounds == 3 and ci.point == pytest.approx(2.0)
    late = tuple(dataclasses.replace(b, round=b.round + 3) for b in blocks([20.0, 20.0, 20.0]))
    assert paired_speedup(base, late).point == pytest.approx(2.0)


def test_sequential_rounds_stop_at_the_planned_count_when_asked():
    job = RoundsJob(f"{TINY}:make_task", (get_policy("fp32"), get_policy("fp64")), "train", rounds=3, block=3,
                    batch_size=8, seed=0, device="cpu", weights=None, max_rounds=0)
    assert all(len(b) == 3 for b in run_rounds(job).blocks.values())
    more = run_rounds(dataclasses.replace(job, max_rounds=9))
    assert 3 <= len(more.blocks["fp32"]) <= 9 and len(more.blocks["fp64"]) <= len(more.blocks["fp32"])

def test_a_policy_already_outside_the_constraints_is_not_timed_again(tmp_path, every_policy_in_rounds):
    """bf16's outputs cannot reach a worst cosine of 0.9999999 (an 8-bit mantissa): it is rejected by its own run,
    so the rounds time only fp32 and fp64; the decision and its record say why bf16 has no interval."""
    report = bench(f"{TINY}:make_task", "fp64,bf16", mode="infer", steps=8, rounds=3, min_cosine=0.9999999,
                   isolate=False, hardware=fake_hardware(), json_path=str(tmp_path / "r.json"))
    bf16, fp64 = report.result("bf16"), report.result("fp64")
    assert report.recommendation.verdict("bf16").verdict.value == "cosine"
    assert not bf16.rounds and bf16.speedup_ci is None and bf16.timing  # its own run's timing stays
    # 3 rounds at least; more where fp64's interval still straddles the band (on an AVX2 CPU a tiny step is about
    # as fast in fp64 as in fp32)
    assert len(fp64.rounds) >= 3 and fp64.speedup_ci is not None
    assert report.recommendation.chosen == "fp32"
    assert any(n.startswith("bf16: not timed in the rounds") for n in report.recommendation.notes)
    assert report.recommendation.verdict("bf16").speedup is not None  # the medians' ratio still shows

def test_a_disturbed_probe_or_baseline_never_skips_a_policy_as_slow(monkeypatch):
    from dtypelab.core.disturbance import Disturbance
    from dtypelab.core.machine import hardware

    class Busy:
        def start(self):
            pass

        def stop(self):
            return Disturbance(wall_s=1.0, other_cpu_s=0.9, steal_s=0.0, pressure_s=None, involuntary_switches=0)

    probes = []
    monkeypatch.setattr(hardware, "CpuMeter", Busy)
    monkeypatch.setattr(hardware, "PROBE_PAUSE_S", 0.0)
    monkeypatch.setattr(hardware, "probe",
                        lambda dev, budget, speed=False: probes.append(dev) or fake_hardware(fp16_gflops=0.5))
    notices = []
    report = bench(f"{TINY}:make_task", "fp16", steps=4, warmup=1, rounds=0, isolate=False,
                   on_event=lambda e: notices.append(e.label) if e.kind == "notice" else None)
    assert len(probes) == 1 + hardware.PROBE_RETRIES  # probed again while disturbed, then said so
    assert report.result("fp16").status != "skipped"  # fp16 'measured' 200x slower by a disturbed probe
    assert any("the hardware probe was disturbed (other processes used 0.90 of a core" in n for n in notices)
    assert report.environment["hardware"]["disturbed"].endswith("during 3 probes")
    monkeypatch.undo()

    class Spy:
        name, seen = "spy", []

        def run(self, job, timeout_s, on_step):
            self.seen.append((job.policy, job.slow_step_s, job.slow_span_s))
            return Outcome("ok", value=PolicyResult(
                job.policy, "ok", batch_size=8, step_times_s=(0.02, 0.01, 0.03), losses=(1.0,),
                metrics={"accuracy": 0.9},
                wall_s=1.0, disturbance={"wall_s": 1.0, "other_cores": 0.9} if job.policy == "fp32" else {}))

    bench(f"{TINY}:make_task", "bf16", launcher=Spy(), hardware=fake_hardware(), budget=0, rounds=0)
    # fp32 timed under disturbance: the bar is 10x its fastest step, and a run is judged by its own fastest step
    # over SLOW_SPAN_S of timed steps (a burst of other work cannot slow all of them)
    from dtypelab.core.measure import SLOW_SPAN_S
    assert Spy.seen == [("fp32", None, 0.0), ("bf16", pytest.approx(0.1), SLOW_SPAN_S)]


def test_the_rounds_time_each_policys_first_call_and_the_notes_say_what_a_warm_cache_saves():
    """A compiled policy's first call in its own run compiles with whatever cache there is; the rounds compile it
    again from the cache that run filled. Both figures are in the record, and a note says what a re-run saves."""
    job = RoundsJob(f"{TINY}:make_task", (get_policy("fp32"), get_policy("fp64")), "infer", rounds=3, block=2,
                    batch_size=8, seed=0, device="cpu", weights=None, warmup=1)
    result = run_rounds(job)
    assert set(result.first_call_s) == {"fp32", "fp64"} and all(s > 0 for s in result.first_call_s.values())

    from dtypelab.core.policies import policy_info
    from dtypelab.core.records import judged

    def compiled(name, cold, warm):
        return PolicyResult(name, "ok", batch_size=8, warmup=0, step_times_s=(0.01,) * 3, metrics={"acc": 0.96},
                            info=policy_info(get_policy(name)), first_call_s=cold, rounds_first_call_s=warm)
    cfg = RunConfig(task="t", mode="infer", policies=("fp32", "fp32+compile", "bf16+compile"), steps=3,
                    batch_size=8, warmup=0, seed=0, tolerance="1%", device="cpu", force=False, timeout_s=1,
                    metric="acc", higher_is_better=True)
    base = PolicyResult("fp32", "ok", batch_size=8, warmup=0, step_times_s=(0.01,) * 3, metrics={"acc": 0.96})
    cold = judged(Report(cfg, {"hardware": {}}, (base, compiled("fp32+compile", 30.0, 3.0),
                                                    compiled("bf16+compile", 12.5, 2.5))))
    notes = cold.recommendation.notes
    assert any("fp32+compile: the first call took 30.0 s" in n and "3.0 s when the rounds compiled it again" in n
               for n in notes)
    assert any(n.startswith("Compiling took 42 s of this sweep") and "about 37 s shorter" in n for n in notes)
    warm = judged(Report(cfg, {"hardware": {}}, (base, compiled("fp32+compile", 3.5, 3.0))))
    assert not any(n.startswith("Compiling took") for n in warm.recommendation.notes)


def _report_with_fp32_median(median_s: float, mode: str = "infer") -> Report:
    cfg = RunConfig(task="t", mode=mode, policies=("fp32", "bf16"), steps=20, batch_size=4, warmup=1, seed=0,
                    tolerance=0.01, device="cpu", force=False, timeout_s=60, metric="m", higher_is_better=True,
                    rounds=3, rounds_block=4)
    fp32 = PolicyResult("fp32", "ok", step_times_s=(median_s,) * 6, warmup=1)
    return Report(cfg, {}).with_result(fp32)


def test_long_inference_passes_are_timed_one_per_round_and_short_ones_keep_their_block():
    from dtypelab.core.measure import ROUND_BLOCK_S
    from dtypelab.sweep.rounds import round_block as _infer_block

    job = RoundsJob("t", (), "infer", 3, 4, 4, 0, "cpu", None)
    assert _infer_block(_report_with_fp32_median(0.6), job) == 1  # minilm's pass on 2 cores
    assert _infer_block(_report_with_fp32_median(ROUND_BLOCK_S / 2), job) == 2
    assert _infer_block(_report_with_fp32_median(0.001), job) == 4  # never more than configured
    train = dataclasses.replace(job, mode="train")
    assert _infer_block(_report_with_fp32_median(0.6, "train"), train) == 4
