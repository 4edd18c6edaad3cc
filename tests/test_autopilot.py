"""The live precision autopilot: a layer moved before it overflows, a surprise overflow rolled back and fixed, nothing
moved when nothing comes near a limit, flushed gradients, a NaN no format fixes, and the record and plan it leaves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import HERE, fake_hardware
from test_policies import global_state

import dtypelab
from dtypelab import Autocast, Cast, DtypelabError, Plan, Precision, load_plan, load_record
from dtypelab.core.results import Rules
from dtypelab.piloting.controller import Controller, crossing_step
from dtypelab.piloting.monitor import Reading

TASKS = os.path.join(os.path.dirname(HERE), "examples", "autopilot_tasks.py")
DRIFT, CALM = f"{TASKS}:make_drift_task", f"{TASKS}:make_calm_task"
LEVELING, LINEAR = f"{TASKS}:make_leveling_task", f"{TASKS}:make_linear_task"


def run(task: str, **settings):
    settings.setdefault("force", True)  # fp16 is slow on most CPUs; these models are tiny
    return dtypelab.autopilot(task, hardware=fake_hardware(), **settings)


@pytest.fixture(scope="module")
def fp32_accuracy() -> float:
    report = dtypelab.bench(DRIFT, "fp32", isolate=False, rounds=0, hardware=fake_hardware())
    return report.result("fp32").metrics["accuracy"]


def test_static_amp_fp16_diverges_on_the_drift_case():
    report = dtypelab.bench(DRIFT, "amp-fp16", isolate=False, rounds=0, force=True, hardware=fake_hardware())
    assert report.result("amp-fp16").status == "diverged"


def test_a_layer_drifting_toward_the_limit_is_moved_alone_before_it_overflows(fp32_accuracy):
    report = run(DRIFT, start="amp-fp16", sample_every=5)
    assert report.status == "ok" and not report.rollbacks
    assert [(m.layer, m.from_, m.to) for m in report.moves] == [("fc1", "amp-fp16", "fp32")]
    move = report.moves[0]
    # by its trend, at under half the limit, before the headroom rule (50% on two readings) could see it
    assert move.cause == "trend" and move.amax < 0.5 * move.limit and "crosses the limit at about step" in move.evidence
    assert len(report.losses) == 70 and all(math.isfinite(v) for v in report.losses)
    assert report.metrics["accuracy"] >= fp32_accuracy - 0.01
    assert report.final_plan["rules"] == [{"pattern": "fc1", "config": {"kind": "cast", "dtype": "float32"}}]


def test_an_overflow_between_readings_is_rolled_back_and_its_layer_moved(fp32_accuracy):
    report = run(DRIFT, start="amp-fp16", sample_every=40)  # too few readings to see it coming
    assert report.status == "ok"
    assert [r.layer for r in report.rollbacks] == ["fc1"] and "float16" in report.rollbacks[0].origin
    assert [(m.layer, m.cause) for m in report.moves] == [("fc1", "non-finite")]
    assert report.steps_rolled_back >= 1 and len(report.losses) == 70
    assert all(math.isfinite(v) for v in report.losses)
    assert report.metrics["accuracy"] >= fp32_accuracy - 0.01


def test_rollbacks_are_bounded():
    report = run(DRIFT, start="amp-fp16", sample_every=40, max_rollbacks=0)
    assert report.status == "stopped" and len(report.rollbacks) == 1 and "rollbacks did not fix it" in report.reason


@pytest.mark.parametrize("start", ["amp-fp16", "amp-bf16", "bf16"])
def test_nothing_near_a_limit_moves_nothing_and_every_global_is_restored(start):
    before = global_state()
    report = run(CALM, start=start, sample_every=2)
    assert global_state() == before
    assert report.status == "ok" and report.moves == () and report.rollbacks == ()
    assert report.samples == 35 and report.final_plan["rules"] == []


def test_gradients_flushed_to_zero_without_a_scaler_move_the_layers_they_flush_in():
    start = Plan(Autocast("float16"), name="amp-fp16-no-scaler")  # autocast without GradScaler
    report = run(f"{TASKS}:make_tiny_loss_task", start=start, sample_every=2)
    moved = {m.layer: m for m in report.moves}
    assert {"fc1", "fc2"} <= set(moved) and all(m.cause == "underflow" for m in moved.values())
    assert "GradScaler" in moved["fc2"].evidence
    assert report.losses[-1] < 0.5 * report.losses[0]  # it learns once the gradients are kept


def test_a_nan_no_wider_format_fixes_stops_with_the_diagnosis():
    report = run(f"{TASKS}:make_log_zero_task", start="amp-fp16", sample_every=2)
    assert report.status == "stopped" and report.moves == ()
    assert len(report.rollbacks) == 1 and report.finding.origin.op == "aten.log"
    assert "log of zero" in report.reason


def test_one_spike_moves_nothing_and_a_sustained_one_does():
    c = Controller(Rules(headroom=0.5, horizon=10))
    limit = torch.finfo(torch.float16).max
    assert c.decide(0, {"a": Reading(torch.float16, 0.6 * limit)}) == {}
    assert c.decide(5, {"a": Reading(torch.float16, 1.0)}) == {}  # the spike passed: the count starts again
    assert c.decide(10, {"a": Reading(torch.float16, 0.6 * limit)}) == {}
    assert set(c.decide(15, {"a": Reading(torch.float16, 0.6 * limit)})) == {"a"}
    assert set(Controller(Rules(0.5, 10)).decide(0, {"b": Reading(torch.float16, 0.95 * limit)})) == {"b"}  # at once


def test_a_rising_trend_moves_a_layer_while_it_is_still_far_from_the_limit():
    c = Controller(Rules(headroom=0.5, horizon=20))  # doubling every 5 steps: 20 steps is 4 doublings
    limit = torch.finfo(torch.float16).max
    moved = {}
    for step, amax in ((0, limit / 64), (5, limit / 32), (10, limit / 16), (15, limit / 8)):
        moved = c.decide(step, {"a": Reading(torch.float16, amax)})
    assert moved["a"].cause == "trend" and moved["a"].amax == limit / 8
    flat = Controller(Rules(headroom=0.5, horizon=10))
    for step in range(0, 100, 5):
        assert flat.decide(step, {"a": Reading(torch.float16, 1000.0 + step)}) == {}  # slow growth: far off


def test_the_trend_rule_needs_the_layer_past_its_floor_and_growth_that_keeps_up():
    limit = torch.finfo(torch.float16).max
    doubling = [(s, limit / 2 ** (12 - s / 5)) for s in range(0, 60, 5)]  # x2 every 5 steps
    assert crossing_step(doubling[-4:], limit) == 60
    # fast early growth that levels off: a line through all four readings would cross at step 43; the last
    # reading's growth is a tenth of the line's slope
    leveling = [(0, limit / 4096), (10, limit / 256), (20, limit / 24), (30, limit / 20)]
    assert crossing_step(leveling, limit, keep=1e-9) == 43 and crossing_step(leveling, limit) is None
    linear = [(s, 600.0 * s) for s in (20, 30, 40, 50)]  # grows by the same amount each reading
    assert crossing_step(linear, limit, keep=0.8) is None
    # a rising line that would cross within the horizon, still under the floor: counted, never moved on
    c = Controller(Rules(headroom=0.5, horizon=30, trend_from=0.1))
    for step, amax in doubling[:9]:  # up to step 40: 6.25% of the limit
        assert c.decide(step, {"a": Reading(torch.float16, amax)}) == {}, step
    assert c.layers["a"].counts["trend"] >= 2
    moved = c.decide(45, {"a": Reading(torch.float16, doubling[9][1])})  # 12.5% of the limit: past the floor
    assert moved["a"].cause == "trend"


@pytest.mark.parametrize(("task", "every"), [(LEVELING, 10), (LINEAR, 5), (LINEAR, 10)])
def test_a_layer_that_levels_off_or_grows_linearly_is_never_moved(task, every):
    """Controls: growth that a straight line through log(amax) of the readings extrapolates to an overflow (the old
    rule, no floor and no check that the growth keeps up, moved each of these by trend at under 10% of fp16's
    limit), and that never gets past 16% of it."""
    old = run(task, start="amp-fp16", sample_every=every, trend_from=0.0, trend_keep=1e-9)
    assert [m.cause for m in old.moves] == ["trend"] and old.moves[0].amax < 0.1 * old.moves[0].limit
    report = run(task, start="amp-fp16", sample_every=every)
    assert report.status == "ok" and report.moves == () and report.rollbacks == ()
    rules = report.config.rules  # the rules are in the record
    assert rules.trend_from == 0.1 and rules.trend_keep == 0.5


def test_autopilot_options_are_checked_when_the_session_is_made():
    for bad, name in (({"promote_to": "fp8"}, "promote_to"), ({"headroom": 2}, "headroom"),
                      ({"trend_keep": 0}, "trend_keep"), ({"bogus": 1}, "bogus")):
        with pytest.raises(DtypelabError, match=f"^{name}:"):
            dtypelab.session(autopilot=bad)


def test_a_layer_moved_out_of_a_pure_cast_keeps_training_with_its_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    precision = Precision(dtypelab.get_policy("bf16"))
    model = precision.convert_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    for _ in range(2):
        opt.zero_grad()
        model(precision.convert_input(x)).float().sum().backward()
        opt.step()
    plan = precision.promote(model, "0", Cast("float32"), opt)
    assert model[0].weight.dtype == torch.float32 and opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert plan.rules == (("0", Cast("float32")),) and precision.plan == plan
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    out = model(precision.convert_input(x))
    assert out.dtype == torch.bfloat16  # the next layer still gets what it expects
    out.float().sum().backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)


def test_the_record_renders_and_the_plan_file_runs_in_bench(tmp_path):
    path, plan_path = str(tmp_path / "ap.json"), str(tmp_path / "plan.json")
    report = run(DRIFT, start="amp-fp16", sample_every=5, json_path=path, plan_out=plan_path)
    again = load_record(path)
    assert again == report
    plan = load_plan(plan_path)
    assert dict(plan.rules) == {"fc1": Cast("float32")} and plan.default == Autocast("float16", scaler=True)
    bench = dtypelab.bench(DRIFT, [plan], isolate=False, rounds=0, force=True, hardware=fake_hardware())
    assert bench.result(plan.name).status == "ok"
    page = str(tmp_path / "page.html")
    dtypelab.report([path], page)
    assert "fc1" in (tmp_path / "page.html").read_text()


def test_ctrl_c_keeps_the_timeline(tmp_path):
    path = str(tmp_path / "ap.json")

    def progress(done: int, total: int) -> None:
        if done == 62:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(DRIFT, start="amp-fp16", sample_every=5, json_path=path, progress=progress)
    saved = load_record(path)
    assert saved.status == "interrupted" and [m.layer for m in saved.moves] == ["fc1"]


SCRIPT = os.path.join(os.path.dirname(HERE), "examples", "autopilot_script.py")


def test_a_script_overflow_between_readings_is_rolled_back_and_its_layer_moved(fp32_accuracy, tmp_path):
    """A script's step cannot be replayed: the forward of the failing step names the origin, the steps since the
    checkpoint are dropped, and training goes on with the script's next batch."""
    heard = []
    report = run(SCRIPT, start="amp-fp16", sample_every=40, json_path=str(tmp_path / "a.json"),
                 plan_out=str(tmp_path / "p.json"), on_move=heard.append)
    assert report.status == "ok" and report.live, report.reason
    assert [(r.layer, r.step) for r in report.rollbacks] == [("fc1", 59)] and "float16" in report.rollbacks[0].origin
    assert [(m.layer, m.cause) for m in report.moves] == [("fc1", "non-finite")] == [(m.layer, m.cause) for m in heard]
    assert report.steps_rolled_back == 59 - report.rollbacks[0].to_step + 1
    assert len(report.losses) == 70 - report.steps_rolled_back and all(math.isfinite(v) for v in report.losses)
    assert report.metrics["accuracy"] >= fp32_accuracy - 0.01
    assert load_record(str(tmp_path / "a.json")).moves == report.moves
    assert load_plan(str(tmp_path / "p.json")).rules == (("fc1", Cast("float32")),)


def test_a_script_nan_no_wider_format_fixes_stops_with_the_diagnosis():
    report = run(SCRIPT, start="amp-fp16", script_args=("--case", "log-zero"))
    assert report.status == "stopped" and not report.moves and len(report.rollbacks) == 1
    assert "log of zero" in report.reason and report.finding is not None


@pytest.mark.e2e
def test_session_autopilot_runs_a_script_on_its_own():
    """`dtypelab.session(autopilot=...)` in a script run as `python train.py`: moves said on stderr as they happen,
    the summary at finish, exit 1 when it had to stop."""
    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)

    drift = script("--autopilot", "amp-fp16")
    assert drift.returncode == 0, drift.stderr
    # the automatic reading interval follows measured costs: the trend or, past it, the overflow moves fc1
    assert "fc1 amp-fp16 → fp32 (" in drift.stderr and "ok, from amp-fp16; moved fc1 → fp32" in drift.stderr
    assert float(drift.stdout.split()[-1]) >= 0.95
    calm = script("--autopilot", "amp-bf16", "--case", "calm", "--no-finish")
    assert calm.returncode == 0 and "moved nothing" in calm.stderr and "no metric" in calm.stderr
    stopped = script("--autopilot", "amp-fp16", "--case", "log-zero")
    assert stopped.returncode == 1 and "log of zero" in stopped.stderr and "Traceback" not in stopped.stderr


@pytest.mark.e2e
def test_a_framework_trainer_is_refused_before_it_trains():
    """Lightning's Trainer owns autocast and the GradScaler: the session refuses at attach, before any step."""
    pytest.importorskip("lightning")
    script = os.path.join(os.path.dirname(HERE), "examples", "train_lightning.py")
    report = run(script, start="amp-fp16")
    assert report.status == "failed" and "Lightning" in report.reason and not report.losses
    from dtypelab.render.autopilot import autopilot_doc

    assert "the run failed" in autopilot_doc(report)[2][0][-1]


def test_a_bad_target_or_option_is_one_line(tmp_path):
    with pytest.raises(DtypelabError, match="promote-to"):
        run(CALM, start="amp-bf16", promote_to="fp8")
    with pytest.raises(DtypelabError, match="arguments after -- are for a training script"):
        run(CALM, start="amp-bf16", script_args=("--x",))
    with pytest.raises(DtypelabError, match="inference-only"):
        run(SCRIPT, start="int8-dyn")
    with pytest.raises(DtypelabError, match="inference-only"):
        dtypelab.session(autopilot="int8-dyn")


def cli(*args: str) -> subprocess.CompletedProcess:
    from test_cli import dtypelab as in_process

    return in_process(*args)


def test_the_command_prints_each_move_and_the_timeline_and_exits_1_when_it_had_to_stop(tmp_path):
    out = cli("autopilot", DRIFT, "--force", "--sample-every", "5", "--json", str(tmp_path / "a.json"),
              "--plan-out", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    assert "step 55: fc1 amp-fp16 → fp32" in out.stderr  # said as it happened
    assert "move" in out.stdout and "final plan: fc1 → fp32" in out.stdout
    assert json.loads((tmp_path / "p.json").read_text())["rules"][0]["pattern"] == "fc1"
    md = cli("show", str(tmp_path / "a.json"), "--format", "markdown")
    assert md.returncode == 0 and "| step |" in md.stdout
    stopped = cli("autopilot", f"{TASKS}:make_log_zero_task", "--force", "--json", str(tmp_path / "b.json"))
    assert stopped.returncode == 1 and "log of zero" in stopped.stdout
    calm = cli("autopilot", SCRIPT, "--force", "--json", str(tmp_path / "c.json"), "--", "--case", "calm")
    assert calm.returncode == 0, calm.stderr
    assert "no layer came near" in calm.stdout and "metrics: accuracy" in calm.stdout
    bad = cli("autopilot", CALM, "--promote-to", "fp8")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_version_1_record_reads_its_flat_thresholds_into_the_rules(tmp_path):
    """Version 1 kept headroom, horizon, trend_from and trend_keep as the config's own fields."""
    from dtypelab.core.results import AutopilotReport

    report = run(CALM, start="amp-bf16", steps=12, headroom=0.6, horizon=7, trend_from=0.2, trend_keep=0.4)
    d = report.to_dict()
    rules = d["config"].pop("rules")
    assert rules["headroom"] == 0.6 and rules["horizon"] == 7
    d["config"].update({k: rules[k] for k in ("headroom", "horizon", "trend_from", "trend_keep")})
    d["schema_version"] = 1
    assert AutopilotReport.from_dict(d) == report
