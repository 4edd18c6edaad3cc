"""The run layer: one launcher protocol, one channel, one error model, one decision of Task or script."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from conftest import TINY, started_with

from dtypelab.core.errors import DtypelabError
from dtypelab.run import LAUNCHERS, InlineLauncher, ProcessLauncher, ScriptLauncher, ScriptRun, Target
from dtypelab.run.channel import ENV_CHANNEL, connect

HERE = os.path.dirname(__file__)


@dataclass(frozen=True)
class Work:
    """A piece of work whose behaviour a test chooses (picklable: it travels to the worker)."""

    how: str
    name: str = "work"

    def __call__(self, report):
        had_wave = "wave" in sys.modules  # a module nothing here imports: only a zygote's preload puts it there
        report.step(1, 2)
        if self.how == "raise":
            raise ValueError("planted")
        if self.how == "segfault":
            import ctypes

            ctypes.string_at(0)
        if self.how == "hang":
            time.sleep(60)
        if self.how == "nap":
            time.sleep(2)
        if self.how == "oom":
            raise MemoryError
        report.step(2, 2)
        if self.how == "numpy":
            import numpy  # noqa: F401
        return {"value": 42, "pid": os.getpid(), "ppid": os.getppid(), "had_wave": had_wave}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    """The child imports ``Work`` by name, as it imports a capability's job: from this folder."""
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_inline_and_process_launchers_give_the_same_outcomes(tmp_path):
    for launcher in (InlineLauncher(), ProcessLauncher(str(tmp_path))):
        steps: list[tuple[int, int]] = []
        out = launcher.run(Work("ok"), 30, lambda d, t, seen=steps: seen.append((d, t)))
        assert out.ok and out.value["value"] == 42 and steps[-1] == (2, 2) and out.ranks == (0,)
        failed = launcher.run(Work("raise"), 30, lambda d, t: None)
        assert failed.status == "failed" and failed.reason.startswith("ValueError: planted (at test_run.py:")
        assert launcher.run(Work("oom"), 30, lambda d, t: None).status == "oom"
    child = ProcessLauncher(str(tmp_path)).run(Work("ok"), 30, lambda d, t: None)
    assert child.value["pid"] != os.getpid() and child.started


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(p))
        except (OSError, IndexError, ValueError):
            continue
    return out


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_crash_or_a_hang_in_a_child_becomes_an_outcome_and_no_process_is_left(tmp_path, monkeypatch, fork):
    """Forked from the zygote or a fresh interpreter, the same outcomes, and nothing left running."""
    import threading
    import uuid

    token = uuid.uuid4().hex
    monkeypatch.setenv("DTYPELAB_FORK", fork)
    monkeypatch.setenv("LEAK_PROBE", token)  # not DTYPELAB_*: a zygote is started anew with it
    launcher = ProcessLauncher(str(tmp_path))
    crash = launcher.run(Work("segfault"), 30, lambda d, t: None)
    assert crash.status == "failed" and "SIGSEGV" in crash.reason
    seen: set[int] = set()
    watch = threading.Timer(1.5, lambda: seen.update(started_with(token)))
    watch.start()
    start = time.monotonic()
    hang = launcher.run(Work("hang"), 3, lambda d, t: None)
    watch.join()
    assert hang.status == "timeout" and "3 s time limit" in hang.reason and time.monotonic() - start < 20
    zygote = {launcher._zygote.proc.pid} if launcher._zygote and launcher._zygote.proc else set()
    assert bool(zygote) == (fork == "1")
    assert seen - zygote, "the hanging worker was not seen: the check below would see no leak either"
    assert not started_with(token) - zygote
    zygote = launcher._zygote
    assert (zygote is not None and zygote.proc is not None) == (fork == "1")
    if zygote is not None and zygote.proc is not None:
        assert not _children(zygote.proc.pid)  # its workers are gone too
        zygote.close()
        assert zygote.proc is None


def test_cpu_work_forks_from_a_warm_zygote_that_keeps_heavy_libraries(tmp_path, monkeypatch):
    monkeypatch.delenv("DTYPELAB_FORK", raising=False)
    assert ProcessLauncher.forks(Work("ok"))  # on by default
    launcher = ProcessLauncher(str(tmp_path))
    first = launcher.run(Work("numpy"), 60, lambda d, t: None)
    zygote = launcher._zygote
    assert first.ok and zygote is not None and first.value["ppid"] == zygote.proc.pid
    assert "numpy" in zygote.warm  # the worker said it loaded numpy: the zygote imports it before the next fork
    second = launcher.run(Work("ok"), 60, lambda d, t: None)
    assert second.ok and second.value["ppid"] == zygote.proc.pid and second.value["pid"] != first.value["pid"]
    monkeypatch.setenv("SOME_IMPORT_SETTING", "1")  # the environment modules import under changed: a new zygote
    third = launcher.run(Work("ok"), 60, lambda d, t: None)
    assert third.ok and third.value["ppid"] == zygote.proc.pid != first.value["ppid"]
    assert not launcher.forks(type("CudaWork", (), {"device": "cuda:0"})())  # CUDA work: a fresh interpreter
    monkeypatch.setenv("DTYPELAB_FORK", "0")
    fresh = launcher.run(Work("ok"), 60, lambda d, t: None)
    assert fresh.ok and fresh.value["ppid"] == os.getpid()
    zygote.close()


def test_a_zygote_started_early_imports_ahead_and_outlives_torchs_own_settings(tmp_path, monkeypatch):
    """``prestart`` starts the zygote and has it import what the first worker will need while the caller works on;
    torch's writing its inductor cache folder into the environment (as it does once imported) does not make that
    zygote stale (it did: the warm zygote was killed and started again, 5 s of a forecast's start), nor pytest's."""
    monkeypatch.delenv("DTYPELAB_FORK", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    launcher = ProcessLauncher(str(tmp_path))
    launcher.prestart(("wave",))
    zygote = launcher._zygote
    assert zygote is not None and zygote.proc is not None
    early = zygote.proc.pid
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # nor does pytest's naming the test that runs (new at each test: every test that forked had a zygote started)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_next (call)")
    out = launcher.run(Work("ok"), 60, lambda d, t: None)
    assert out.ok and out.value["ppid"] == early and out.value["had_wave"]
    plain = ProcessLauncher(str(tmp_path)).run(Work("ok"), 60, lambda d, t: None)  # no preload: not there
    assert plain.ok and not plain.value["had_wave"]
    zygote.close()


def test_a_zygote_started_early_is_stopped_at_once_when_the_command_ends_on_bad_input(tmp_path, monkeypatch):
    """A forecast starts its worker's zygote before it reads the task; on bad input it ends at once, not after the
    zygote's imports (they added 5 s to a one-line error)."""
    monkeypatch.delenv("DTYPELAB_FORK", raising=False)
    launcher = ProcessLauncher(str(tmp_path))
    launcher.prestart(("transformers.modeling_utils",))  # seconds of imports
    zygote = launcher._zygote
    assert zygote is not None and zygote.proc is not None
    proc, start = zygote.proc, time.monotonic()
    zygote.close()
    assert time.monotonic() - start < 3 and proc.poll() is not None and zygote.proc is None


def test_a_zygote_keeps_a_request_that_comes_while_its_worker_runs(tmp_path, monkeypatch):
    """A warm-up sent while a worker runs is answered after it (it used to be read and dropped: the next worker then
    waited two minutes for its answer and started fresh)."""
    import threading

    monkeypatch.delenv("DTYPELAB_FORK", raising=False)
    launcher = ProcessLauncher(str(tmp_path))
    outs = []
    running = threading.Thread(target=lambda: outs.append(launcher.run(Work("nap"), 60, lambda d, t: None)))
    running.start()
    time.sleep(1.0)  # the worker is forked and napping
    launcher.prestart(("wave",))
    running.join()
    start = time.monotonic()
    after = launcher.run(Work("ok"), 60, lambda d, t: None)
    zygote = launcher._zygote
    assert outs[0].ok and after.ok and after.value["had_wave"] and time.monotonic() - start < 30
    assert after.value["ppid"] == outs[0].value["ppid"] == zygote.proc.pid  # the same zygote throughout
    zygote.close()


def test_a_script_runs_as_itself_with_its_session_as_the_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport dtypelab\nlab = dtypelab.session()\nprint('argv', sys.argv[1:])\n"
                      "lab.setup(__import__('torch').nn.Linear(2, 2))\nlab.finish(accuracy=0.5)\n")
    job = {"plan": {"name": "fp32", "default": {"kind": "cast", "dtype": "float32"}, "rules": []}, "seed": 3,
           "device": "cpu"}
    out = ScriptLauncher(str(tmp_path)).run(ScriptRun(str(script), ("--x", "1"), 3, job, name="fp32"), 60,
                                            lambda d, t: None)
    assert out.ok and out.started and type(out.value).__name__ == "ScriptResult"
    assert out.value.metrics == {"accuracy": 0.5}
    with open(tmp_path / "fp32.log") as f:
        assert "argv ['--x', '1']" in f.read()
    silent = tmp_path / "silent.py"
    silent.write_text("print('no session')\n")
    never = ScriptLauncher(str(tmp_path)).run(ScriptRun(str(silent), name="x"), 60, lambda d, t: None)
    assert never.ok and never.value is None and not never.started  # the capability says what is missing


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_script_forked_from_the_zygote_ends_as_a_fresh_interpreter_would(tmp_path, monkeypatch, fork):
    """Forked (the default on a CPU machine) or fresh, a script gets the same exit code, its atexit hooks, its
    threads joined and Python's usual Ctrl-C; a forked one starts from the zygote, which then keeps what it
    imported that is heavy."""
    monkeypatch.setenv("DTYPELAB_FORK", fork)
    mark = tmp_path / "mark.txt"
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, os, signal, sys, threading, time\nimport numpy\nimport dtypelab\n"
        f"mark = {str(mark)!r}\n"
        "open(mark, 'w').write(str(os.getppid()) + ' ')\n"
        "open(mark + '.sigint', 'w').write(str(signal.getsignal(signal.SIGINT) is signal.default_int_handler))\n"
        "def late():\n    time.sleep(0.3)\n    open(mark, 'a').write('thread ')\n"
        "threading.Thread(target=late).start()\n"
        "atexit.register(lambda: open(mark, 'a').write('atexit'))\n"
        "lab = dtypelab.session()\nlab.setup(__import__('torch').nn.Linear(2, 2))\n"
        "lab.finish(accuracy=0.5)\nsys.exit(sys.argv[1] if sys.argv[1:] else None)\n")
    job = {"plan": {"name": "fp32", "default": {"kind": "cast", "dtype": "float32"}, "rules": []}, "seed": 0,
           "device": "cpu"}
    launcher = ScriptLauncher(str(tmp_path))
    assert launcher.forks(ScriptRun(str(script), (), 0, job)) == (fork == "1")
    out = launcher.run(ScriptRun(str(script), (), 0, job, name="ok"), 60, lambda d, t: None)
    assert out.ok and out.value.metrics == {"accuracy": 0.5}
    # Ctrl-C as Python itself sets it up in a fresh interpreter started from here (ignored when this test runs in a
    # background job, e.g. nohup pytest &, where SIGINT comes in ignored)
    fresh = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is "
                            "signal.default_int_handler, end='')"], capture_output=True, text=True, timeout=60)
    assert (tmp_path / "mark.txt.sigint").read_text() == fresh.stdout
    parent, *rest = mark.read_text().split()
    assert rest == ["thread", "atexit"]  # the thread was joined before the atexit hooks ran, as at a normal exit
    assert (int(parent) != os.getpid()) == (fork == "1")  # forked: the zygote is its parent
    bad = launcher.run(ScriptRun(str(script), ("no data found",), 0, job, name="bad"), 60, lambda d, t: None)
    assert bad.status == "failed" and bad.reason == "the script exited with code 1: no data found"
    if fork == "1":
        from dtypelab.run.script import _zygote

        assert "numpy" in _zygote().warm


def test_target_decides_once_whether_a_task_or_a_script(tmp_path):
    assert Target.of("digits").kind == "task" and Target.of(f"{TINY}:make_task").kind == "task"
    assert Target.of(os.path.join(HERE, "scripts", "probe_script.py")).is_script
    with pytest.raises(DtypelabError, match="it is a training script"):
        Target.of(os.path.join(HERE, "scripts", "probe_script.py")).task()
    assert set(LAUNCHERS) == {"inline", "process"}


def test_work_that_does_not_load_in_the_worker_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "")
    out = ProcessLauncher(str(tmp_path)).run(Work("ok"), 30, lambda d, t: None)
    assert out.status == "failed" and out.reason.startswith("the worker could not load its work: ModuleNotFoundError")


def test_a_program_run_on_its_own_has_no_channel(monkeypatch):
    monkeypatch.delenv(ENV_CHANNEL, raising=False)
    assert connect() is None


def test_the_entry_modules_run_with_python_m_without_runpy_warnings(monkeypatch):
    """The package imports neither ``worker`` nor ``boot``: runpy would warn in every fresh worker's log otherwise."""
    import subprocess
    import sys

    monkeypatch.delenv(ENV_CHANNEL, raising=False)
    code = ("import dtypelab.run, sys; "
            "print(sorted(m for m in ('dtypelab.run.worker', 'dtypelab.run.boot') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "dtypelab.run.worker"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "started by a dtypelab launcher" in run.stderr and "Warning" not in run.stderr


def test_a_failure_names_the_users_line_never_one_of_dtypelabs_own():
    """An error raised inside dtypelab (any package of it, not only core/) is not "at job.py:264": the location
    names the innermost frame of the user's own code, and none when there is none."""
    import os

    import dtypelab
    from dtypelab.core.errors import describe_exception

    def raised(filename: str) -> BaseException:  # raised and caught in a frame of ``filename`` alone
        space: dict = {}
        code = "try:\n    raise ValueError('layout: no such layer')\nexcept ValueError as exc:\n    caught = exc\n"
        exec(compile(code, filename, "exec"), space)
        return space["caught"]

    package = os.path.dirname(dtypelab.__file__)
    for inner in ("sweep/job.py", "forecasting/forecaster.py", "core/loop.py"):
        assert describe_exception(raised(os.path.join(package, inner))) == "ValueError: layout: no such layer"
    mine = describe_exception(raised("/home/me/train.py"))
    assert mine == "ValueError: layout: no such layer (at train.py:2 in <module>)"


def test_a_worker_names_the_parts_of_lazily_importing_libraries_it_used():
    """transformers and peft import their models on first use: the zygote is told those parts too, or each worker
    imports BERT's modeling again (seconds on 2 cores)."""
    pytest.importorskip("transformers")
    import importlib

    from dtypelab.run import heavy_modules

    importlib.import_module("transformers.models.bert.modeling_bert")
    named = heavy_modules()
    assert "transformers" in named and "transformers.models.bert.modeling_bert" in named
    assert not any(m.startswith("dtypelab") for m in named)  # never a module of dtypelab's or the user's
    deep = [m for m in named if "." in m and m != "torch._dynamo"]
    assert deep and all(m.partition(".")[0] in ("transformers", "peft") for m in deep)


def test_every_test_that_sends_sigint_starts_its_child_with_sigint_at_its_default():
    """CI may start the suite with SIGINT ignored (``bash .ci/run &`` from a script), a disposition every child
    inherits: a child a test sends SIGINT must be started with ``conftest.interruptible``, or it ignores the signal
    and the test fails only there. Checked in every test file, and the helper checked under an ignoring parent."""
    import re
    import signal as signals

    from conftest import HERE, interruptible

    sends = re.compile(r"send_signal\(\s*signal\.SIGINT|kill(pg)?\([^)]*SIGINT")
    offenders = []
    for name in sorted(os.listdir(HERE)):
        if name.endswith(".py") and name != os.path.basename(__file__):
            with open(os.path.join(HERE, name)) as f:
                text = f.read()
            if sends.search(text) and "preexec_fn=interruptible" not in text:
                offenders.append(name)
    assert not offenders, f"these send SIGINT to a child started without preexec_fn=interruptible: {offenders}"
    previous = signals.signal(signals.SIGINT, signals.SIG_IGN)
    try:
        asked = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, end='')"
        ignored = subprocess.run([sys.executable, "-c", asked], capture_output=True, text=True, timeout=60)
        helped = subprocess.run([sys.executable, "-c", asked], capture_output=True, text=True, timeout=60,
                                preexec_fn=interruptible)
    finally:
        signals.signal(signals.SIGINT, previous)
    assert (ignored.stdout, helped.stdout) == ("False", "True")
