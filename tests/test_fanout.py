"""Fan-out through submitit's local executor: the code path Slurm takes, on this CPU machine (slots are CPU
processes when there is no GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from conftest import HERE, TINY, fake_hardware

from dtypelab import bench
from dtypelab.core.errors import DtypelabError
from dtypelab.core.records import load_report
from dtypelab.run import FanOutLauncher, parse_gpus, parse_minutes, parse_slurm_args

pytest.importorskip("submitit")


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    """A job unpickles its work by importing the work's module: this file's ``Work`` must import there, as a
    user's own classes must on the nodes."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (HERE, os.environ.get("PYTHONPATH")))))


@dataclass(frozen=True)
class Work:
    """Sleeps a little, reporting steps; then does what its name says."""

    name: str
    seconds: float = 0.4

    def __call__(self, report):
        for i in range(4):
            time.sleep(self.seconds / 4)
            report(i + 1, 4)
        if self.name.startswith("raise"):
            raise ValueError("planted")
        if self.name.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.name.startswith("hang"):
            time.sleep(3600)
        return {"pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _launcher(tmp_path, slots=2):
    return FanOutLauncher("local-gpus", str(tmp_path / "jobs"), cpu_slots=slots, poll_s=0.1)


@pytest.mark.e2e
def test_jobs_run_side_by_side_and_each_failure_is_its_own_outcome(tmp_path):
    states, came = [], []
    out = _launcher(tmp_path, slots=3).run_many(
        [Work("a", 2.0), Work("raise", 2.0), Work("kill", 2.0)], 120,
        lambda name, state, done, total: states.append((name, state, done, total)),
        lambda work, outcome: came.append(work.name))
    assert out["a"].ok and "job" in out["a"].where and out["a"].value["gpus"] == ""  # a CPU slot: no GPU visible
    running, most = set(), 0
    for name, state, *_ in states:
        (running.add if state == "running" else running.discard)(name)
        most = max(most, len(running))
    assert most >= 2  # side by side
    assert out["raise"].status == "failed" and "ValueError: planted" in out["raise"].reason
    assert out["kill"].status == "failed" and "ended without a result" in out["kill"].reason
    assert sorted(came) == ["a", "kill", "raise"]
    assert ("a", "running") in {(n, s) for n, s, *_ in states}
    assert any(n == "a" and d > 0 and t == 4 for n, s, d, t in states)  # steps come through the shared folder


@pytest.mark.e2e
def test_a_job_past_its_time_limit_is_stopped(tmp_path):
    start = time.monotonic()
    out = _launcher(tmp_path, 1).run_many([Work("hang")], 3)
    assert out["hang"].status == "timeout" and "3 s time limit" in out["hang"].reason
    assert time.monotonic() - start < 60


@pytest.mark.e2e
def test_ctrl_c_cancels_every_job_not_finished(tmp_path):
    launcher = _launcher(tmp_path)
    jobs = []

    def interrupt(name, state, done, total):
        if state == "running":
            raise KeyboardInterrupt

    real = launcher._submit

    def keep(*args):
        running = real(*args)
        jobs.extend(r.job for r in running)
        return running

    launcher._submit = keep  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        launcher.run_many([Work("hang1"), Work("hang2")], 120, interrupt)
    deadline = time.monotonic() + 30
    while not all(j.done() for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert jobs and all(j.done() for j in jobs)


@pytest.mark.e2e
def test_a_fanned_out_sweep_keeps_what_finished_and_a_rerun_picks_it_up(tmp_path, monkeypatch):
    """bf16's job dies without a word (SIGKILL, as the OOM killer or a lost node ends one): the others count, the
    record says where each ran; a re-run with the same --json measures fp32 and bf16 again and keeps fp64."""
    # fp64 is timed in the rounds however slow its own run was here (an AVX2 CPU can put it under 0.6x fp32)
    monkeypatch.setattr("dtypelab.sweep.interleave.clearly_slower", lambda report, ran: set())
    path = str(tmp_path / "r.json")
    task = f"{TINY}:make_killed_task"
    monkeypatch.setenv("TINY_KILL", "1")
    report = bench(task, "fp64,bf16", steps=12, rounds=2, launcher=_launcher(tmp_path), hardware=fake_hardware(),
                   json_path=path)
    bf16, fp64 = report.result("bf16"), report.result("fp64")
    assert bf16.status == "failed" and "ended without a result" in bf16.reason
    assert fp64.status == "ok" and fp64.ran_on and report.result("fp32").ran_on
    assert report.rounds_on and fp64.rounds  # the rounds ran on one place, said in the record
    assert fp64.init_fingerprint == report.result("fp32").init_fingerprint  # one set of initial weights
    assert any(n.startswith("Where each learning run went: fp32 on ") for n in report.recommendation.notes)
    saved = load_report(path)
    assert saved.result("bf16").status == "failed" and saved.result("fp64").ran_on == fp64.ran_on

    said = []
    monkeypatch.delenv("TINY_KILL")  # what killed it has passed (a pre-emption, a full node)
    again = bench(task, "fp64,bf16", steps=12, rounds=2, launcher="inline", hardware=fake_hardware(),
                  json_path=path, on_event=lambda e: said.append(e.label))
    assert again.result("fp64").step_times_s == fp64.step_times_s  # kept, not measured again
    assert again.result("bf16").status == "ok" and not again.result("bf16").ran_on
    assert again.result("fp32").step_times_s != report.result("fp32").step_times_s  # the yardstick: again
    assert any("kept 1 finished run(s) of the interrupted sweep" in s and "(fp64)" in s for s in said)
    # a complete record, or --fresh, is measured anew
    third = bench(task, "fp64,bf16", steps=12, rounds=2, launcher="inline", hardware=fake_hardware(),
                  json_path=path)
    assert third.result("fp64").step_times_s != fp64.step_times_s


def test_fan_out_settings_are_checked():
    assert parse_gpus("0,1,3") == (0, 1, 3) and parse_gpus(None) is None
    assert parse_minutes("90") == 90 and parse_minutes("1:30:00") == 90 and parse_minutes("2-00:00:00") == 2880
    assert parse_minutes("10:30") == 11  # MM:SS, rounded up to whole minutes
    assert parse_slurm_args("account=ml, qos=high") == {"account": "ml", "qos": "high"}
    for parse, text, message in ((parse_gpus, "0,x", "GPU indices"), (parse_gpus, "1,1", "each GPU index once"),
                                 (parse_minutes, "soon", "minutes or HH:MM:SS"),
                                 (parse_slurm_args, "account", "KEY=VALUE")):
        with pytest.raises(DtypelabError, match=message):
            parse(text)
    for settings, message in (({"gpus": "0"}, "--gpus picks the GPUs of --launcher local-gpus"),
                              ({"partition": "gpu"}, "--partition is a Slurm setting"),
                              ({"launcher": "slurm", "nproc": 2}, "use one or the other"),
                              ({"launcher": "local-gpu"}, "unknown launcher 'local-gpu'")):
        with pytest.raises(DtypelabError, match=message):
            bench(f"{TINY}:make_task", "bf16", hardware=fake_hardware(), **settings)
    for settings, message in (({"launcher": "slurm"}, "a training script runs as its own program"),):
        with pytest.raises(DtypelabError, match=message):
            bench(os.path.join(HERE, "..", "examples", "train_loop.py"), "bf16", hardware=fake_hardware(), **settings)


def test_the_slurm_executor_gets_the_users_settings(tmp_path, monkeypatch):
    with pytest.raises(DtypelabError, match="no Slurm here"):
        FanOutLauncher("slurm", str(tmp_path))._executor(None, 600, 1)
    for tool in ("srun", "sbatch"):  # submitit's own check: a cluster's commands on PATH (nothing is submitted here)
        (tmp_path / tool).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    launcher = FanOutLauncher("slurm", str(tmp_path), gpus_per_job=2, partition="gpu", time_min=90,
                              slurm_args={"account": "ml"})
    ex = launcher._executor(None, 600, 5)
    p = ex._executor.parameters
    assert p["partition"] == "gpu" and p["time"] == 90 and p["gpus_per_node"] == 2 and p["array_parallelism"] == 5
    assert p["additional_parameters"] == {"account": "ml"}
    default = FanOutLauncher("slurm", str(tmp_path))._executor(None, 600, 1)._executor.parameters
    assert default["time"] == 15  # the work's own limit (10 min) plus a margin: dtypelab's timeout speaks first


@pytest.mark.cuda
def test_one_gpu_slot_measures_what_the_default_launcher_does(tmp_path):
    """On a GPU machine: the local-GPU launcher with one slot gives the same record as the default launcher, within
    noise (the same policies finish, the same initial weights, metrics within the tolerance's reach)."""
    fan = bench(f"{TINY}:make_task", "bf16,amp-bf16", steps=30, launcher="local-gpus", gpus="0",
                jobs_folder=str(tmp_path / "jobs"), json_path=str(tmp_path / "fan.json"))
    plain = bench(f"{TINY}:make_task", "bf16,amp-bf16", steps=30, json_path=str(tmp_path / "plain.json"))
    for name in ("fp32", "bf16", "amp-bf16"):
        a, b = fan.result(name), plain.result(name)
        assert a.status == b.status == "ok" and a.init_fingerprint == b.init_fingerprint
        assert "GPU 0" in a.ran_on and abs(a.metrics["accuracy"] - b.metrics["accuracy"]) <= 0.05
    assert "GPU 0" in fan.rounds_on


IGNORED_SIGINT = r"""
import pathlib, sys, tempfile, time
from test_fanout import Work, _launcher
launcher, jobs = _launcher(pathlib.Path(tempfile.mkdtemp())), []
real = launcher._submit
launcher._submit = lambda *a: [jobs.append(r.job) or r for r in real(*a)]
def interrupt(name, state, done, total):
    if state == "running":
        raise KeyboardInterrupt
try:
    launcher.run_many([Work("hang1"), Work("hang2")], 120, interrupt)
except KeyboardInterrupt:
    pass
end = time.monotonic() + 30
while not all(j.done() for j in jobs) and time.monotonic() < end:
    time.sleep(0.2)
print(len(jobs), all(j.done() for j in jobs))
"""


@pytest.mark.e2e
def test_ctrl_c_cancels_the_jobs_of_a_process_that_ignores_sigint(tmp_path):
    """A background job of a non-interactive shell (CI) ignores SIGINT, and so would the local controllers it starts:
    submitit cancels them with SIGINT. They must start with the default disposition."""
    run = subprocess.run([sys.executable, "-c", IGNORED_SIGINT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": HERE}, cwd=str(tmp_path),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert run.stdout.split() == ["2", "True"], run.stdout + run.stderr
