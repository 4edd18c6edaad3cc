"""Script mode: a user's own training script, a Lightning Trainer and a Hugging Face Trainer, measured per policy."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import avx2_hardware, fake_hardware
from test_cli import dtypelab as cli
from torch import nn

import dtypelab
from dtypelab.core.task import is_script
from dtypelab.run.channel import ENV_CHANNEL, Channel

HERE = os.path.dirname(__file__)
EXAMPLES = os.path.join(HERE, "..", "examples")
PROBE = os.path.join(HERE, "scripts", "probe_script.py")
SCHED = os.path.join(HERE, "scripts", "sched_script.py")


@pytest.mark.parametrize("name", ["train_loop", "train_lightning", "train_hf"])
def test_examples_need_at_most_six_changed_lines(name):
    with open(os.path.join(EXAMPLES, "plain", f"{name}.py")) as f:
        plain = f.read().splitlines()
    with open(os.path.join(EXAMPLES, f"{name}.py")) as f:
        measured = f.read().splitlines()
    changed = [ln for ln in difflib.unified_diff(plain, measured, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ln[1:].strip()]
    added = [ln for ln in changed if ln.startswith("+")]
    assert 0 < len(added) <= 6, changed


def test_a_script_is_told_apart_from_a_task_file_without_running_it(tmp_path):
    assert is_script(PROBE) and is_script(os.path.join(EXAMPLES, "train_loop.py"))
    task_file = tmp_path / "t.py"
    task_file.write_text("raise SystemExit('must not run')\ndef make_task():\n    pass\n")
    assert not is_script(str(task_file)) and not is_script(f"{PROBE}:make_task") and not is_script("digits")


def test_the_script_runs_normally_without_dtypelab_driving_it():
    env = {k: v for k, v in os.environ.items() if k != ENV_CHANNEL}
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_loop.py"), "--epochs", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("accuracy ") and "dtypelab" not in run.stdout


def _session(tmp_path, monkeypatch, policy: str) -> dtypelab.Session:
    """A session driven as the script launcher drives one: connected to a channel, sent its job."""
    channel = Channel({"plan": dtypelab.get_policy(policy).to_dict(), "seed": 0, "device": "cpu"})
    for key, value in channel.env.items():
        monkeypatch.setenv(key, value)
    lab = dtypelab.session()
    lab.channel = channel  # the launcher's end, for the test to read what the session sent
    return lab


def _sent(lab):
    """The session's last word: what it measured."""
    done = [m for m in lab.channel.drain(timeout=0.5) if type(m).__name__ == "Done"]
    lab.channel.close()
    return done[-1].value


def _model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, torch.randn(32, 16), torch.randint(0, 4, (32,))


def test_clipping_under_amp_fp16_unscales_first(tmp_path, monkeypatch):
    model, x, y = _model_and_batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    true_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model, x, y = _model_and_batch()
    lab = _session(tmp_path, monkeypatch, "amp-fp16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = lab.setup(model, optimizer)
    lab.backward(nn.functional.cross_entropy(model(x), y))
    assert lab.precision.grad_scale() > 1000  # the gradients it holds are scaled ...
    norm = float(lab.clip_gradients(model, max_norm=1e9))
    assert norm == pytest.approx(true_norm, rel=1e-2)  # ... and were unscaled before the norm
    optimizer.step()
    assert len(lab.timer.samples) == 1 and len(lab.losses) == 1
    lab.finish(accuracy=0.5)
    result = _sent(lab)
    assert result.scaler["grad_scale"] and result.batch_size == 32 and result.metric == "accuracy"
    assert not torch.is_autocast_enabled("cpu")


def test_finish_needs_a_metric_and_guesses_its_direction(tmp_path, monkeypatch):
    lab = _session(tmp_path, monkeypatch, "fp32")
    lab.setup(nn.Linear(2, 2))
    with pytest.raises(dtypelab.DtypelabError, match="needs the metric"):
        lab.finish()
    lab.finish(val_loss=0.3)
    result = _sent(lab)
    assert result.higher_is_better is False and result.higher_guessed is True


@pytest.mark.slow
@pytest.mark.e2e  # whole real scripts, several runs each: CI's second step
def test_script_sweep_same_shuffle_crash_and_missing_calls(tmp_path):
    report = dtypelab.bench(PROBE, "fp32,bf16,amp-bf16", script_args=["--crash-under", "amp-bf16"], runs=1,
                            json_path=str(tmp_path / "r.json"), hardware=fake_hardware())
    fp32, bf16, amp = (report.result(n) for n in ("fp32", "bf16", "amp-bf16"))
    assert fp32.status == bf16.status == "ok" and report.config.metric == "accuracy"
    assert fp32.metrics["first_batch"] == bf16.metrics["first_batch"]  # the same shuffle
    assert fp32.init_fingerprint == bf16.init_fingerprint  # the same initial weights
    assert len(fp32.step_times_s) == 8 and fp32.batch_size == 32 and len(fp32.losses) == 8
    assert amp.status == "failed" and "planted failure under amp-bf16" in amp.reason
    assert dtypelab.load_report(str(tmp_path / "r.json")).result("bf16").status == "ok"
    missing = dtypelab.bench(PROBE, "fp32", script_args=["--no-finish"]).result("fp32")
    assert missing.status == "failed" and "lab.finish(" in missing.reason
    none = dtypelab.bench(PROBE, "fp32", script_args=["--no-session"]).result("fp32")
    assert none.status == "failed" and "dtypelab.session()" in none.reason


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_cli_runs_the_plain_loop_example(tmp_path, fast_bf16_env):
    out = tmp_path / "loop.json"
    run = subprocess.run([sys.executable, "-m", "dtypelab", "bench", os.path.join(EXAMPLES, "train_loop.py"), "-p",
                          "fp32,amp-bf16", "--runs", "1", "--json", str(out), "--", "--epochs", "1"],
                         capture_output=True, text=True, timeout=600, env=fast_bf16_env)
    assert run.returncode == 0, run.stderr
    assert "train_loop.py -- --epochs 1" in run.stdout and "accuracy" in run.stdout
    report = dtypelab.load_report(str(out))
    assert [r.status for r in report.results] == ["ok", "ok"] and report.config.script_args == ("--epochs", "1")
    assert report.result("fp32").batch_size == 64  # two accumulated micro-batches of 32
    bad = subprocess.run([sys.executable, "-m", "dtypelab", "bench", os.path.join(EXAMPLES, "train_loop.py"),
                          "--steps", "5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "runs its own loop" in bad.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_lightning_example_is_measured_per_policy():
    pytest.importorskip("lightning")
    report = dtypelab.bench(os.path.join(EXAMPLES, "train_lightning.py"), "fp32,bf16,amp-bf16", runs=1,
                            script_args=["--epochs", "1"],
                          hardware=fake_hardware())
    for r in report.results:
        assert r.status == "ok", (r.policy, r.reason)
        assert r.step_times_s and r.losses and "val_acc" in r.metrics and r.batch_size == 32
    assert report.config.metric == "val_acc" and report.result("bf16").model_bytes < report.result("fp32").model_bytes


@pytest.mark.e2e
@pytest.mark.slow
def test_hf_example_is_measured_per_policy():
    pytest.importorskip("transformers")
    report = dtypelab.bench(os.path.join(EXAMPLES, "train_hf.py"), "fp32,amp-bf16,amp-fp16", runs=1,
                            script_args=["--epochs", "1"],
                          hardware=fake_hardware(fp16_gflops=200.0))
    fp32, amp = report.result("fp32"), report.result("amp-bf16")
    assert fp32.status == amp.status == "ok" and report.config.metric == "eval_accuracy"
    assert len(fp32.losses) == len(fp32.step_times_s) > 10 and fp32.batch_size == 32
    # the Trainer's own optimizer and the step's gradients are counted (they once read 0.00)
    memory = fp32.memory
    assert memory["gradients"] == memory["parameters"] > 0 and memory["optimizer_state"] >= 2 * memory["parameters"]
    if not torch.cuda.is_available():  # accelerate does not autocast to float16 on a CPU: skipped, not faked
        assert report.result("amp-fp16").status == "skipped"


def test_a_policy_the_trainer_cannot_express_is_refused_before_anything_runs(tmp_path):
    """A script on dtypelab.hf.Trainer named with a policy the Trainer has no equivalent of (a per-module plan): one
    line, non-zero, before the baseline runs. A plain loop takes it."""
    hf_script = os.path.join(EXAMPLES, "train_hf.py")
    plan = tmp_path / "mixed.json"
    plan.write_text(json.dumps({"default": "fp32", "rules": {"classifier": "bf16"}}))
    with pytest.raises(dtypelab.DtypelabError, match=r"policy mixed: train_hf\.py trains with dtypelab\.hf\.Trainer, "
                                                     r"which has no TrainingArguments equivalent of a per-module plan; "
                                                     r"name the others"):
        dtypelab.bench(hf_script, f"fp32,{plan}", json_path=str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()  # nothing ran
    sft_script = os.path.join(HERE, "scripts", "sft_trainer.py")  # TRL's SFTTrainer: the same, by its name
    with pytest.raises(dtypelab.DtypelabError, match=r"policy mixed: sft_trainer\.py trains with "
                                                     r"dtypelab\.hf\.SFTTrainer, which has no TrainingArguments"):
        dtypelab.bench(sft_script, f"fp32,{plan}", json_path=str(tmp_path / "r.json"))
    run = cli("bench", hf_script, "-p", f"fp32,{plan}")
    assert run.returncode != 0 and "name the others" in run.stderr and "Traceback" not in run.stderr


def test_a_loss_choice_is_refused_for_a_script_which_computes_its_own_loss(tmp_path):
    for script in ("train_loop.py", "train_hf.py"):
        with pytest.raises(dtypelab.DtypelabError, match=r"policy fp32\+chunked-ce: \+chunked-ce computes a task's "
                                                         r"loss, and a script computes its own"):
            dtypelab.bench(os.path.join(EXAMPLES, script), "fp32,fp32+chunked-ce", json_path=str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["peft_trainer.py", "sft_trainer.py"])
def test_a_peft_model_under_the_trainer_is_measured_with_its_own_adapters_under_base_precisions(name):
    """A script whose adapters are peft's (applied by the script, or by TRL's SFTTrainer from its ``peft_config``),
    trained with dtypelab.hf.Trainer or dtypelab.hf.SFTTrainer: run alone it trains as without dtypelab; under bench
    every LoRA policy keeps those adapters (the same trainable weights) and puts the base in the policy's format
    (bfloat16 halves it, int8 and NF4 shrink it), the Trainer autocasting to bfloat16 where the policy computes in it;
    the metric judged as for any, fp32's equal to the script's own run."""
    script = os.path.join(HERE, "scripts", name)
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    own = float(re.findall(r"'eval_loss': ([0-9.]+)", alone.stdout)[-1])
    report = dtypelab.bench(script, "fp32,lora-bf16-pure,lora-int8,qlora-nf4", runs=1,
                            hardware=fake_hardware(fp16_gflops=200.0))
    runs = {r.policy: r for r in report.results}
    assert all(r.status == "ok" for r in runs.values()), {r.policy: r.reason for r in runs.values()}
    # the same training: equal to float32's rounding (sums split differently among the worker's threads)
    assert runs["fp32"].metrics["eval_loss"] == pytest.approx(own, rel=1e-5)
    frozen = {name: r.memory["frozen_weights"] for name, r in runs.items()}
    trainable = {name: r.memory["parameters"] for name, r in runs.items()}
    assert frozen["fp32"] == 2 * frozen["lora-bf16-pure"] > frozen["lora-int8"] > frozen["qlora-nf4"] > 0
    # the script's own 14,336 bytes of float32 adapter weights (rank 4 on q and v of two layers); pure bfloat16 halves
    assert trainable["fp32"] == trainable["lora-int8"] == trainable["qlora-nf4"] == 2 * trainable["lora-bf16-pure"]
    assert trainable["fp32"] == 14_336
    for r in runs.values():
        assert r.metrics["eval_loss"] == pytest.approx(runs["fp32"].metrics["eval_loss"], rel=0.01)


@pytest.mark.e2e
def test_lora_settings_a_scripts_own_peft_model_does_not_take_end_bench_with_an_error(tmp_path):
    """The script makes its peft model itself: --lora-rank (or --lora-targets, --lora-alpha, --kbit-upcast) has
    nothing to set. The LoRA policy fails with that one line, fp32's run is kept in the record, and bench exits 2."""
    script = os.path.join(HERE, "scripts", "peft_trainer.py")
    run = cli("bench", script, "-p", "fp32,lora-bf16", "--lora-rank", "32", "--json", str(tmp_path / "r.json"),
              "--", "--steps", "4")
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lora-rank does not apply to this model: it has LoRA adapters of its own")
    record = json.loads((tmp_path / "r.json").read_text())
    assert {r["policy"]: r["status"] for r in record["results"]} == {"fp32": "ok", "lora-bf16": "failed"}


@pytest.mark.e2e
@pytest.mark.slow
def test_trace_and_audit_arm_on_the_scripts_own_loop(tmp_path):
    nan_script = os.path.join(HERE, "scripts", "nan_script.py")
    report = dtypelab.trace(nan_script)
    assert report.status == "found" and report.live and report.config.task == nan_script
    origin = report.finding.origin
    assert origin.op == "aten.log" and origin.source.endswith("nan_script.py:18") and "log_softmax" in origin.diagnosis
    out = tmp_path / "audit.json"
    run = cli("audit", os.path.join(EXAMPLES, "train_loop.py"), "--steps", "3", "--json", str(out), "--", "--epochs",
              "1")
    assert run.returncode == 0, run.stderr
    audit = dtypelab.load_record(str(out))
    assert len(audit.losses) == 3 and any(layer.kind == "param_grad" for layer in audit.layers)
    assert any(layer.name == "0" and layer.kind == "activation" for layer in audit.layers)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_is_traced_from_its_bad_step_in_a_second_run_and_one_that_does_not_repeat_is_said(tmp_path):
    """A clean script runs once, untraced; one that goes non-finite runs again with the tracer armed from that step
    (the finding says how many steps ran untraced first); one whose NaN does not come back when run again from the
    same seed is a failed trace that says so, and --every-step traces it in one run."""
    runs = tmp_path / "runs.txt"
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, sys, torch\nimport dtypelab\n"
        f"runs = {str(runs)!r}\nopen(runs, 'a').write('run ')\n"
        "once = os.path.getsize(runs) <= 4 if sys.argv[1] == 'once' else sys.argv[1] == 'always'\n"
        "lab = dtypelab.session()\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nmodel, opt = lab.setup(model, opt)\n"
        "for step in range(6):\n"
        "    out = model(torch.randn(8, 4))\n"
        "    loss = (out - 1).pow(2).mean() + (torch.log(torch.zeros(())) if once and step == 3 else 0)\n"
        "    lab.backward(loss)\n    opt.step()\n    opt.zero_grad()\n"
        "lab.finish(loss=float(loss))\n")

    def count() -> int:
        n = runs.read_text().count("run") if runs.exists() else 0
        runs.write_text("")
        return n

    clean = dtypelab.trace(str(script), script_args=["never"])
    assert clean.status == "clean" and len(clean.losses) == 6 and count() == 1
    found = dtypelab.trace(str(script), script_args=["always"])
    assert found.status == "found" and found.finding.step == 3 and found.finding.replayed_steps == 3 and count() == 2
    assert found.finding.origin.op == "aten.log"
    flaky = dtypelab.trace(str(script), script_args=["once"])
    assert flaky.status == "failed" and "does not repeat itself" in flaky.reason and "--every-step" in flaky.reason
    runs.unlink()
    every = dtypelab.trace(str(script), script_args=["once"], every_step=True)
    assert every.status == "found" and every.finding.replayed_steps == 0 and count() == 1


def _plain(script: str, *args: str) -> str:
    """The script's output run on its own, without dtypelab driving it."""
    env = {k: v for k, v in os.environ.items() if k != ENV_CHANNEL}
    run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.e2e  # whole real scripts, several runs each: CI's second step
@pytest.mark.parametrize("order", ["before", "after", "chain"])
def test_schedulers_and_ema_in_any_order_run_alone_and_under_bench(order):
    """An LR scheduler built after lab.setup once died at `step_fn.__func__`; the script must run unchanged alone
    and under bench, and its driven fp32 run must train exactly as its plain run (it seeds itself with 7)."""
    args = ["--order", order, "--accumulate", "2"]
    alone = _plain(SCHED, *args)
    policies = "fp32,amp-bf16" if order == "chain" else "fp32"  # the crash came at setup, whatever the policy
    report = dtypelab.bench(SCHED, policies, script_args=args, hardware=fake_hardware(), runs=1)
    for r in report.results:
        assert r.status == "ok", (r.policy, r.reason)
    fp32 = report.result("fp32")
    assert alone.startswith(f"accuracy {fp32.metrics['accuracy']:.6f} lr {fp32.metrics['lr']:.6g}")
    assert fp32.metrics["lr"] != 0.1  # the scheduler really stepped
    # the recorded loss is the loss the step trained on: its micro-batches' mean, not 1/accumulate of it
    assert fp32.losses[-1] == pytest.approx(fp32.metrics["last_loss"], rel=1e-5)


def test_a_step_loss_is_its_micro_batches_added_up(tmp_path, monkeypatch):
    model, x, y = _model_and_batch()
    lab = _session(tmp_path, monkeypatch, "fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = lab.setup(model, optimizer)
    halves = [nn.functional.cross_entropy(model(xb), yb) for xb, yb in ((x[:16], y[:16]), (x[16:], y[16:]))]
    for loss in halves:
        lab.backward(loss / 2)
    optimizer.step()
    assert lab.losses == [pytest.approx((float(halves[0].detach()) + float(halves[1].detach())) / 2)]
    assert isinstance(optimizer.step, __import__("types").MethodType) and optimizer.step.__self__ is optimizer
    lab.finish(accuracy=1.0)
    result = _sent(lab)
    assert result.disturbance["wall_s"] > 0 and "disturbed" in result.disturbance


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("example", ["train_loop", "train_lightning", "train_hf"])
def test_the_measured_example_run_alone_trains_exactly_as_the_plain_one(example):
    """dtypelab.lightning.Trainer once re-seeded torch with 0, undoing the script's own seed: run alone, the
    measured version of each example must print exactly what the plain one prints, with a seed other than 0."""
    if example != "train_loop":
        pytest.importorskip("lightning" if example == "train_lightning" else "transformers")
    args = ["--epochs", "1", "--seed", "42"]
    measured, plain = (_plain(os.path.join(EXAMPLES, *where, f"{example}.py"), *args) for where in ((), ("plain",)))
    if example == "train_hf":  # the Trainer's evaluate() also reports its own timings
        import ast

        measured, plain = ({k: v for k, v in ast.literal_eval(t).items() if "runtime" not in k and "per_second"
                            not in k} for t in (measured, plain))
    assert measured == plain


@pytest.mark.slow
@pytest.mark.e2e  # whole real scripts, several runs each: CI's second step
def test_a_script_run_slow_or_diverging_under_a_policy_is_stopped_early(tmp_path, monkeypatch):
    """bench's protections in script mode: a policy 10x slower per step than fp32 stops after a few steps (here the
    probe lets it through, as a disturbed one would), and one whose loss stays non-finite stops after 10 steps. fp32
    is judged as timed on a quiet machine (its median the bar): a test beside this one under pytest -n would make it
    the fastest step over 5 s of steps, more than this script's 32 steps leave to stop (tests/test_budget.py checks
    that rule). The runs themselves judge their steps quiet too (a sitecustomize the script's process imports first):
    a run that sees other processes take the CPU is never stopped as slow, which a pytest -n neighbour would make
    every run here (test_the_slow_stop_never_judges_the_baselines_own_repeat_nor_a_run_it_saw_disturbed)."""
    monkeypatch.setattr("dtypelab.script.runner.was_disturbed", lambda d: False)
    (tmp_path / "quiet").mkdir()
    (tmp_path / "quiet" / "sitecustomize.py").write_text(
        "from dtypelab.core import disturbance\n"
        "disturbance.Disturbance.disturbed = property(lambda self: False)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "quiet"),
                                                                   os.environ.get("PYTHONPATH")])))
    args = ["--slow-under", "bf16", "--nan-under", "amp-bf16"]
    report = dtypelab.bench(SCHED, "fp32,bf16,amp-bf16", script_args=args, hardware=fake_hardware(), runs=1)
    fp32, slow, nan = (report.result(n) for n in ("fp32", "bf16", "amp-bf16"))
    assert fp32.status == "ok" and len(fp32.step_times_s) == 32
    assert slow.status == "skipped" and slow.skip == "slow" and "pathologically slow" in slow.reason
    assert len(slow.step_times_s) < 10
    assert nan.status == "diverged" and "stopped after 10 non-finite steps" in nan.reason and len(nan.losses) == 13
    assert fp32.disturbance and fp32.disturbance["disturbed"] is False  # the quiet judgement reached the runs


def test_where_bf16_is_slow_a_script_sweep_skips_it_without_running_it():
    report = dtypelab.bench(PROBE, "fp32,bf16", hardware=avx2_hardware())
    bf16 = report.result("bf16")
    assert bf16.status == "skipped" and bf16.skip == "slow" and "no native bfloat16" in bf16.reason
    assert not bf16.step_times_s


@pytest.mark.slow
@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_a_sweep_whose_fp32_baseline_failed_exits_non_zero(tmp_path):
    run = cli("bench", PROBE, "-p", "fp32", "--json", str(tmp_path / "r.json"), "--", "--crash-under", "fp32")
    assert run.returncode == 1 and "fp32 baseline did not complete" in run.stderr and "Traceback" not in run.stderr
    assert dtypelab.load_report(str(tmp_path / "r.json")).result("fp32").status == "failed"


@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_a_failed_fp32_stops_the_sweep_and_its_reason_is_the_exceptions_first_line(tmp_path):
    """A multi-line message's tail ('Check the documentation…') was once the reason; and every other policy ran to
    the end after fp32 had failed."""
    report = dtypelab.bench(PROBE, "fp32,bf16,amp-bf16", script_args=["--multiline-under", "fp32"], runs=1,
                            json_path=str(tmp_path / "r.json"), hardware=fake_hardware())
    fp32 = report.result("fp32")
    assert fp32.status == "failed" and fp32.reason.startswith(
        "the script exited with code 1: ValueError: the first line says what (at probe_script.py:")
    assert "Check the documentation" not in fp32.reason
    for name in ("bf16", "amp-bf16"):
        r = report.result(name)
        assert r.status == "skipped" and r.skip == "baseline" and not r.step_times_s, (name, r)
    assert report.recommendation.no_baseline and "--keep-going runs them anyway" in " ".join(
        report.recommendation.sentences)
    going = dtypelab.bench(PROBE, "fp32,bf16", script_args=["--multiline-under", "fp32"], keep_going=True, runs=1,
                           hardware=fake_hardware())
    assert going.result("bf16").status == "ok" and going.result("fp32").status == "failed"


def test_a_script_that_times_no_step_gets_no_decision_and_exits_non_zero(tmp_path):
    run = cli("bench", PROBE, "-p", "fp32,bf16", "--force", "--runs", "1", "--json", str(tmp_path / "r.json"), "--",
              "--keep-own-model")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("error: the fp32 baseline did not complete (failed: no training step was timed: the "
                            "model lab.setup returned was never called"), error
    assert "Keep fp32" not in run.stdout
    fp32 = dtypelab.load_report(str(tmp_path / "r.json")).result("fp32")
    assert fp32.status == "failed" and not fp32.step_times_s


def test_a_disturbed_probe_skips_nothing_in_script_mode_and_says_so():
    """A busy machine once made the probe read bf16 as 1.7x slower (not 57x) and nothing said so; and another time
    read fp64 as 11x slower and skipped it. A probe still disturbed after re-probing decides no skip."""
    from dataclasses import replace

    notices = []
    busy = replace(avx2_hardware(), disturbed="other processes used 0.96 of a core during 3 probes")
    report = dtypelab.bench(PROBE, "fp32,bf16", hardware=busy, runs=1,
                          on_event=lambda e: notices.append(e.label) if e.kind == "notice" else None)
    assert report.result("bf16").status == "ok"
    assert any(n.startswith("the hardware probe was disturbed (other processes used 0.96") for n in notices)


def test_after_a_disturbed_fp32_a_script_sweep_still_arms_the_slow_check():
    """Outside testers saw bf16 and fp16 run a script to its end (minutes) beside another job: fp32 had been timed
    under disturbance, and the check was off. Now its fastest step arms it, judged over a span of steps."""
    from dtypelab import PolicyResult
    from dtypelab.core.measure import SLOW_SPAN_S
    from dtypelab.script.runner import pace

    steps = (0.5, 0.02, 0.01, 0.03, 0.02)
    quiet = pace(PolicyResult("fp32", "ok", warmup=1, step_times_s=steps), force=False)
    assert quiet["slow_step_s"] == pytest.approx(0.2) and quiet["slow_span_s"] == 0.0  # 10x its median
    busy = pace(PolicyResult("fp32", "ok", warmup=1, step_times_s=steps, disturbance={"disturbed": True}), False)
    assert busy["slow_step_s"] == pytest.approx(0.1) and busy["slow_span_s"] == SLOW_SPAN_S  # 10x its fastest
    assert "slow_step_s" not in pace(PolicyResult("fp32", "ok", warmup=1, step_times_s=steps), force=True)
    assert busy["patience"] and "slow_step_s" not in pace(PolicyResult("fp32", "failed"), force=False)


def test_the_slow_stop_never_judges_the_baselines_own_repeat_nor_a_run_it_saw_disturbed(monkeypatch):
    """Beside a busy process a script sweep with --budget stopped fp32's own second run as "53x slower than fp32's
    fastest step", and lora-bf16 as 49x: the baseline's repeats run without the slow check, and a run that saw
    other processes take the CPU is not stopped for a pace that is theirs."""
    import types

    from dtypelab import PolicyResult
    from dtypelab.core.disturbance import Disturbance
    from dtypelab.core.policies import get_policy
    from dtypelab.script import runner
    from dtypelab.sweep.job import too_slow

    jobs = []

    def fake_run(path, args, job, seed, timeout_s, workdir, on_step, on_message=None):
        jobs.append(job)
        return runner.Outcome("failed", "not run")

    monkeypatch.setattr(runner, "run_script", fake_run)
    runs = runner._Runs(runner.Target.of(os.path.join(EXAMPLES, "train_loop.py")),
                        types.SimpleNamespace(seed=0, script_args=(), timeout_s=60), "cpu", lambda e: None)
    steps = (0.5, 0.02, 0.01, 0.03, 0.02)
    runs.extra, runs.baseline = runner.pace(PolicyResult("fp32", "ok", warmup=1, step_times_s=steps), False), "fp32"
    runs.once(get_policy("fp32"))
    runs.once(get_policy("amp-bf16"))
    assert jobs[0].slow_step_s is None and jobs[0].patience  # fp32's repeat: divergence watched, never "slow"
    assert jobs[1].slow_step_s == pytest.approx(0.2)

    job = types.SimpleNamespace(warmup=1, slow_step_s=0.01, steps=1000, baseline_step_s=0.001, slow_span_s=0.0)
    samples = [1.0] * 8

    class Seen:
        def __init__(self, busy: bool) -> None:
            self.busy = busy

        def stop(self):
            return Disturbance(wall_s=8.0, other_cpu_s=8.0 if self.busy else 0.0, steal_s=0.0, pressure_s=None,
                               involuntary_switches=0, raw_other_cpu_s=8.0 if self.busy else 0.0, resolution_s=0.01)

    assert too_slow(job, samples, Seen(busy=False)).startswith("measured pathologically slow")
    assert too_slow(job, samples, Seen(busy=True)) == ""
