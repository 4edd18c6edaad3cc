"""Script mode: a user's own training script, a Lightning Trainer and a Hugging Face Trainer, measured per policy."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import dtypelab
from dtypelab.script import bench_script, is_script
from dtypelab.script.session import ENV_JOB

HERE = os.path.dirname(__file__)
EXAMPLES = os.path.join(HERE, "..", "examples")
PROBE = os.path.join(HERE, "scripts", "probe_script.py")


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
    env = {k: v for k, v in os.environ.items() if k != ENV_JOB}
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_loop.py"), "--epochs", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("accuracy ") and "dtypelab" not in run.stdout


def _session(tmp_path, monkeypatch, policy: str) -> dtypelab.Session:
    job = tmp_path / f"{policy}.job.json"
    job.write_text(json.dumps({"plan": dtypelab.get_policy(policy).to_dict(), "seed": 0, "device": "cpu"}))
    monkeypatch.setenv(ENV_JOB, str(job))
    return dtypelab.session()


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
    result = json.loads((tmp_path / "amp-fp16.job.json.result").read_text())
    assert result["scaler"]["grad_scale"] and result["batch_size"] == 32 and result["metric"] == "accuracy"
    assert not torch.is_autocast_enabled("cpu")


def test_finish_needs_a_metric_and_guesses_its_direction(tmp_path, monkeypatch):
    lab = _session(tmp_path, monkeypatch, "fp32")
    lab.setup(nn.Linear(2, 2))
    with pytest.raises(dtypelab.DtypelabError, match="needs the metric"):
        lab.finish()
    lab.finish(val_loss=0.3)
    result = json.loads((tmp_path / "fp32.job.json.result").read_text())
    assert result["higher_is_better"] is False and result["higher_guessed"] is True


@pytest.mark.slow
def test_script_sweep_same_shuffle_crash_and_missing_calls(tmp_path):
    report = bench_script(PROBE, "fp32,bf16,amp-bf16", args=["--crash-under", "amp-bf16"],
                          json_path=str(tmp_path / "r.json"))
    fp32, bf16, amp = (report.result(n) for n in ("fp32", "bf16", "amp-bf16"))
    assert fp32.status == bf16.status == "ok" and report.config.metric == "accuracy"
    assert fp32.metrics["first_batch"] == bf16.metrics["first_batch"]  # the same shuffle
    assert fp32.init_fingerprint == bf16.init_fingerprint  # the same initial weights
    assert len(fp32.step_times_s) == 8 and fp32.batch_size == 32 and len(fp32.losses) == 8
    assert amp.status == "failed" and "planted failure under amp-bf16" in amp.reason
    assert dtypelab.load_report(str(tmp_path / "r.json")).result("bf16").status == "ok"
    missing = bench_script(PROBE, "fp32", args=["--no-finish"]).result("fp32")
    assert missing.status == "failed" and "lab.finish(" in missing.reason
    none = bench_script(PROBE, "fp32", args=["--no-session"]).result("fp32")
    assert none.status == "failed" and "dtypelab.session()" in none.reason


@pytest.mark.slow
def test_bench_cli_runs_the_plain_loop_example(tmp_path):
    out = tmp_path / "loop.json"
    run = subprocess.run([sys.executable, "-m", "dtypelab", "bench", os.path.join(EXAMPLES, "train_loop.py"), "-p",
                          "fp32,amp-bf16", "--json", str(out), "--", "--epochs", "1"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert "train_loop.py -- --epochs 1" in run.stdout and "accuracy" in run.stdout
    report = dtypelab.load_report(str(out))
    assert [r.status for r in report.results] == ["ok", "ok"] and report.config.script_args == ("--epochs", "1")
    assert report.result("fp32").batch_size == 64  # two accumulated micro-batches of 32
    bad = subprocess.run([sys.executable, "-m", "dtypelab", "bench", os.path.join(EXAMPLES, "train_loop.py"),
                          "--steps", "5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "runs its own loop" in bad.stderr


@pytest.mark.slow
def test_lightning_example_is_measured_per_policy():
    pytest.importorskip("lightning")
    report = bench_script(os.path.join(EXAMPLES, "train_lightning.py"), "fp32,bf16,amp-bf16", args=["--epochs", "1"])
    for r in report.results:
        assert r.status == "ok", (r.policy, r.reason)
        assert r.step_times_s and r.losses and "val_acc" in r.metrics and r.batch_size == 32
    assert report.config.metric == "val_acc" and report.result("bf16").model_bytes < report.result("fp32").model_bytes


@pytest.mark.slow
def test_hf_example_is_measured_per_policy():
    pytest.importorskip("transformers")
    report = bench_script(os.path.join(EXAMPLES, "train_hf.py"), "fp32,amp-bf16,amp-fp16", args=["--epochs", "1"])
    fp32, amp = report.result("fp32"), report.result("amp-bf16")
    assert fp32.status == amp.status == "ok" and report.config.metric == "eval_accuracy"
    assert len(fp32.losses) == len(fp32.step_times_s) > 10 and fp32.batch_size == 32
    if not torch.cuda.is_available():  # accelerate does not autocast to float16 on a CPU: skipped, not faked
        assert report.result("amp-fp16").status == "skipped"


@pytest.mark.slow
def test_trace_and_audit_arm_on_the_scripts_own_loop(tmp_path):
    nan_script = os.path.join(HERE, "scripts", "nan_script.py")
    report = dtypelab.trace(nan_script)
    assert report.status == "found" and report.live and report.config.task == nan_script
    origin = report.finding.origin
    assert origin.op == "aten.log" and origin.source.endswith("nan_script.py:18") and "log_softmax" in origin.diagnosis
    out = tmp_path / "audit.json"
    run = subprocess.run([sys.executable, "-m", "dtypelab", "audit", os.path.join(EXAMPLES, "train_loop.py"),
                          "--steps", "3", "--json", str(out), "--", "--epochs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    audit = dtypelab.load_record(str(out))
    assert len(audit.losses) == 3 and any(layer.kind == "param_grad" for layer in audit.layers)
    assert any(layer.name == "0" and layer.kind == "activation" for layer in audit.layers)
