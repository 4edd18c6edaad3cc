"""The sweep's time budget and progress without a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import TINY, fake_hardware

from dtypelab import DtypelabError, PolicyResult, bench, recommend
from dtypelab.core.policies import get_policy
from dtypelab.run import Outcome
from dtypelab.sweep.budget import COMPILE_ALLOWANCE_S, estimate, parse_budget


class Clockwork:
    """A launcher whose jobs 'take' planted wall times; records what it was asked to run."""

    name = "clockwork"

    def __init__(self, walls: dict[str, float]) -> None:
        self.walls, self.ran = walls, []

    def run(self, job, timeout_s, on_step):
        self.ran.append(job.policy)
        return Outcome("ok", value=PolicyResult(job.policy, "ok", batch_size=job.batch_size,
                                                step_times_s=(0.01,) * 3, losses=(1.0,), metrics={"accuracy": 0.9},
                                                wall_s=self.walls.get(job.policy, 1.0)))


def test_parse_budget():
    assert parse_budget("15m") == 900 and parse_budget("90s") == 90 and parse_budget("1.5h") == 5400
    assert parse_budget("120") == 120 and parse_budget(60.0) == 60
    assert parse_budget("0") is None and parse_budget(None) is None and parse_budget("none") is None
    for bad in ("soon", "-5m", "1e999"):
        with pytest.raises(DtypelabError, match="bad budget"):
            parse_budget(bad)


def test_estimate_scales_fp32_by_the_probed_kernel_and_adds_compile_time():
    hw = fake_hardware(int8=10.0)  # int8 kernel 10x slower than float32's 100 GFLOP/s
    slow = estimate(get_policy("int8-dyn"), hw, 40.0)
    assert slow.seconds == pytest.approx(400.0) and "10.0x slower" in slow.why
    assert estimate(get_policy("bf16"), hw, 40.0).seconds == 40.0  # faster kernels never estimate below fp32
    compiled = estimate(get_policy("int8-dyn-compile"), hw, 40.0)
    assert compiled.seconds == 400.0 + COMPILE_ALLOWANCE_S and "compiling" in compiled.why  # the same int8 kernel


def test_policies_estimated_past_the_budget_are_skipped_with_the_estimate(tmp_path):
    hw = fake_hardware(int8=20.0)  # int8-dyn: 5x fp32
    clock = Clockwork({"fp32": 30.0})
    report = bench(f"{TINY}:make_task", "int8-dyn,int8-wo,bf16", mode="infer", launcher=clock, hardware=hw,
                   budget="100s", json_path=str(tmp_path / "r.json"), rounds=0)
    skipped = report.result("int8-dyn")
    assert skipped.status == "skipped" and skipped.skip == "budget"
    assert "estimated 150 s (fp32 took 30 s; its kernel measured 5.0x slower)" in skipped.reason
    assert clock.ran == ["fp32", "fp32", "int8-wo", "bf16"]  # the reference training, then the sweep
    text = " ".join(recommend(report).sentences)
    assert "int8-dyn: skipped — over the time budget" in text and "a larger --budget (0: none) runs it" in text
    everything = bench(f"{TINY}:make_task", "int8-dyn", mode="infer", launcher=Clockwork({"fp32": 30.0}),
                       hardware=hw, budget=0, rounds=0)
    assert everything.result("int8-dyn").status == "ok"


def test_time_already_spent_counts_against_the_budget():
    clock = Clockwork({"fp32": 50.0, "bf16": 50.0})
    report = bench(f"{TINY}:make_task", "bf16,amp-bf16", launcher=clock, hardware=fake_hardware(), budget=60,
                   rounds=0)
    # fp32's 50 s are planted, not spent: the estimate (50 s) is judged against the real time left
    assert report.result("bf16").status == "ok"
    tight = bench(f"{TINY}:make_task", "bf16", launcher=Clockwork({"fp32": 50.0}), hardware=fake_hardware(),
                  budget=10, rounds=0)
    assert tight.result("bf16").skip == "budget" and "s left of 10 s" in tight.result("bf16").reason


@pytest.mark.slow
@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_progress_without_a_terminal_prints_lines_and_heartbeats(tmp_path):
    env = {**os.environ, "DTYPELAB_HEARTBEAT_S": "0.3", "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "dtypelab", "bench", f"{TINY}:make_task", "-p", "fp32,fp64",
                          "--steps", "20", "--rounds", "0", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    err = run.stderr
    for text in ("fp32: started (20 steps)", "fp32: ok in", "fp64: started", "fp64: ok in",
                 "still running after"):
        assert text in err, (text, err)
    assert "\x1b[" not in err  # plain text: no terminal escapes in a log


def test_a_policy_measured_10x_slower_than_fp32_on_the_model_stops_early(tmp_path):
    """What a matmul probe misses (fp16 convolutions on a CPU with fast fp16 matmuls) the run itself shows."""
    from dtypelab.core.measure import SLOW_AFTER
    from dtypelab.sweep.job import Job, run_job, too_slow

    for mode in ("train", "infer"):
        job = Job(f"{TINY}:make_task", get_policy("bf16"), mode, 10**9, 8, 2, 0, "cpu", str(tmp_path),
                  slow_step_s=1e-9, baseline_step_s=1e-10)  # 10^9 steps left: stopping saves time
        if mode == "infer":
            run_job(Job(f"{TINY}:make_task", get_policy("fp32"), "infer", 3, 8, 1, 0, "cpu", str(tmp_path)))
        r = run_job(job)
        assert r.status == "skipped" and r.skip == "slow", (mode, r.status, r.reason)
        assert len(r.step_times_s) == 2 + SLOW_AFTER and "x slower; stopped there" in r.reason
    job = Job(f"{TINY}:make_task", get_policy("bf16"), "train", 40, 8, 2, 0, "cpu", str(tmp_path), slow_step_s=1.0)
    assert too_slow(job, [5.0, 5.0, 0.1, 0.1, 0.1]) == ""  # warm-up steps never count
    assert too_slow(job, [0.1, 0.1, 2.0, 2.0]) == ""  # too few timed steps to judge
    assert too_slow(job, [0.1, 0.1, 2.0, 2.0, 0.5]).startswith("measured pathologically slow")
    tiny = Job(f"{TINY}:make_task", get_policy("bf16"), "train", 40, 8, 2, 0, "cpu", str(tmp_path), slow_step_s=1e-4)
    assert too_slow(tiny, [1e-3] * 5) == ""  # 10x slower, but the 35 steps left take 35 ms: nothing to save


def test_after_a_disturbed_fp32_a_run_is_judged_by_its_fastest_step_over_a_span():
    """Other processes only ever add time: fp32's fastest step is the bar's base, and a run is stopped only when
    even its fastest step over SLOW_SPAN_S of steps is 10x that (a burst that slowed a few steps does not)."""
    from dtypelab.core.measure import SLOW_SPAN_S, slow_base, slow_verdict

    assert slow_base([9.0, 0.1, 0.3, 0.2], 1, disturbed=False) == (0.2, 0.0)  # quiet: the median of timed steps
    assert slow_base([9.0, 0.1, 0.3, 0.2], 1, disturbed=True) == (0.1, SLOW_SPAN_S)  # disturbed: the fastest
    assert slow_base([9.0], 1, disturbed=True) is None
    limit = 1.0  # 10x a fastest fp32 step of 0.1 s
    burst = [0.1, 2.0, 2.0, 2.0, 0.5]  # three steps slowed by a burst, then a normal one
    assert slow_verdict(burst, 1, limit, 1000, 0.1, span_s=SLOW_SPAN_S) == ""
    assert slow_verdict(burst, 1, limit, 1000, 0.1) != ""  # by the median, as after a quiet fp32, it would stop
    short = [0.1, 2.0, 2.0]  # slow throughout, but only 2 timed steps / 4 s: not yet judged
    assert slow_verdict(short, 1, limit, 1000, 0.1, span_s=SLOW_SPAN_S) == ""
    slow = [0.1] + [2.0] * 3
    reason = slow_verdict(slow, 1, limit, 1000, 0.1, span_s=SLOW_SPAN_S)
    assert reason.startswith("measured pathologically slow on this model: its fastest step of 3 timed (6 s")
    assert "vs 100 ms for fp32's fastest step, 20x slower" in reason


def test_the_sweep_arms_the_check_from_fp32_and_force_disarms_it():
    seen = []

    class Spy(Clockwork):
        def run(self, job, timeout_s, on_step):
            seen.append((job.policy, job.slow_step_s))
            return super().run(job, timeout_s, on_step)

    bench(f"{TINY}:make_task", "bf16", launcher=Spy({}), hardware=fake_hardware(), budget=0, rounds=0)
    assert seen == [("fp32", None), ("bf16", pytest.approx(0.1))]  # fp32's median 10 ms, x10
    seen.clear()
    bench(f"{TINY}:make_task", "bf16", launcher=Spy({}), hardware=fake_hardware(), budget=0, force=True, rounds=0)
    assert seen == [("fp32", None), ("bf16", None)]


def test_after_fp32_the_sweep_says_what_the_budget_will_skip():
    notices = []
    bench(f"{TINY}:make_task", "int8-dyn,int8-wo", mode="infer", launcher=Clockwork({"fp32": 30.0}),
          hardware=fake_hardware(int8=20.0), budget="100s", rounds=0,
          on_event=lambda e: notices.append(e.label) if e.kind == "notice" else None)
    assert len(notices) == 1
    assert notices[0].startswith("time budget 100 s: the 2 remaining policies are estimated at ~30 s")
    assert "these will be skipped: int8-dyn (~150 s)" in notices[0]


def test_the_compiled_baseline_is_not_run_when_none_of_the_compiled_policies_would_fit_after_it():
    """fp32+compile is added only to time compiled policies against: when at the estimates none of them fits in the
    budget after it, its run would buy a comparison never made (the GPU check's 75 s on an H100)."""
    clock = Clockwork({"fp32": 30.0})
    report = bench(f"{TINY}:make_task", "bf16,amp-bf16,amp-bf16+compile", launcher=clock, hardware=fake_hardware(),
                   budget="100s", rounds=0)
    base = report.result("fp32+compile")
    assert base.status == "skipped" and base.skip == "budget"
    assert "the baseline of amp-bf16+compile alone" in base.reason
    assert "fp32+compile" not in clock.ran and clock.ran[:3] == ["fp32", "bf16", "amp-bf16"]
    # with room for a compiled policy after it, the baseline runs first
    roomy = Clockwork({"fp32": 30.0})
    bench(f"{TINY}:make_task", "amp-bf16+compile", launcher=roomy, hardware=fake_hardware(), budget="300s", rounds=0)
    assert roomy.ran == ["fp32", "fp32+compile", "amp-bf16+compile"]
