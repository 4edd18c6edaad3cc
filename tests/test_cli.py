"""The command line end to end, as a user runs it: through click's test runner in this process (each policy's run
still in a process of its own), with a few commands in a real subprocess too (``subprocess_cli``): the entry point,
exit codes and output of a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
from conftest import HERE, TINY, fake_hardware, hardware_file

SCRIPT = os.path.join(HERE, "scripts", "nan_script.py")


def dtypelab(*args: str, cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``dtypelab ARGS`` in this process (an interpreter and torch import saved per call), answered as a subprocess
    would be: its exit code, stdout and stderr; an exception that escaped a command is a traceback on stderr, as it
    would be there."""
    from typer.testing import CliRunner

    from dtypelab.cli import app

    before = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        result = CliRunner().invoke(app, list(args), env={**(env or {}), "COLUMNS": "200"}, catch_exceptions=True)
    finally:
        os.chdir(before)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["dtypelab", *args], result.exit_code, result.stdout, stderr)


def subprocess_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m dtypelab.cli ARGS`` in a fresh interpreter."""
    env = {**(env or os.environ), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "dtypelab.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_bench_then_show_end_to_end(tmp_path, fast_bf16_env):
    """With a saved bf16-native probe: on a CPU without bf16 arithmetic the bf16 policies would be skipped as slow,
    and the tables below would have one row."""
    out = tmp_path / "out.json"
    run = dtypelab("bench", f"{TINY}:make_task", "--policies", "fp32,amp-bf16,bf16", "--steps", "20",
                   "--json", str(out), env=fast_bf16_env)
    assert run.returncode == 0, run.stderr
    for text in ("fp32", "amp-bf16", "bf16", "step ms", "accuracy", "verdict"):
        assert text in run.stdout
    assert "results saved to" in run.stderr
    data = json.loads(out.read_text())
    # the first sentence printed is the record's decision, in its words
    first = run.stdout[run.stdout.index("• "):].split("• ")[1]
    assert " ".join(first.split()) == " ".join(data["recommendation"]["reason"].split())
    assert data["recommendation"]["decision"] in ("use", "keep-baseline", "keep-baseline-busy", "too-busy")
    assert [r["policy"] for r in data["results"]] == ["fp32", "amp-bf16", "bf16"]
    assert data["environment"]["torch"] and data["environment"]["hardware"]["gflops"]["float32"] > 0

    assert data["config"]["task_name"] == "tiny"
    assert run.stdout.startswith("dtypelab training: tiny · ")  # Task.name, not the file path

    shown = dtypelab("show", str(out))
    assert shown.returncode == 0 and "amp-bf16" in shown.stdout
    md = dtypelab("show", str(out), "--format", "markdown")
    assert md.stdout.count("\n| ") == 8  # a header and 3 policies: the table, then where the memory goes
    assert "where the training memory goes" in md.stdout
    js = dtypelab("show", str(out), "--format", "json")
    assert json.loads(js.stdout) == data


@pytest.mark.parametrize(("args", "message"), [
    (("bench", "missing.py:make_task"), "task file not found: missing.py"),
    (("bench", f"{TINY}:make_tsk"), "did you mean 'make_task'"),
    (("bench", f"{TINY}:make_task", "--policies", "bf61"), "unknown policy 'bf61' (did you mean 'bf16'?)"),
    (("bench", f"{TINY}:make_task", "--policies", "tf32", "--device", "cpu"), "policy tf32 cannot run here"),
    (("bench", f"{TINY}:make_task", "--tolerance", "lots"), "bad tolerance 'lots'"),
    (("bench", f"{TINY}:make_task", "--format", "pdf"), "unknown format 'pdf'"),
    (("show", "nowhere.json"), "no such result file: nowhere.json"),
    (("formats", "--formats", "fp17"), "unknown format 'fp17'; did you mean"),
    (("cast", "nowhere.pt", "--to", "fp16"), "no such file: nowhere.pt"),
    (("cast", TINY, "--to", "fp16"), "unsupported file type .py"),
    (("cast", TINY, "--to", "bf61"), "unknown format 'bf61'"),
    (("audit", f"{TINY}:make_task", "--layers", "(["), "not a valid regular expression"),
    (("audit", f"{TINY}:make_task", "--formats", "int8"), "no subnormal range"),
    (("bench", f"{TINY}:make_task", "-p", "int8-dyn"), "policy int8-dyn is inference-only"),
    (("bench", f"{TINY}:make_task", "--per-layer"), "per_layer compares inference outputs"),
    (("export", f"{TINY}:make_task", "-p", "int8-dyn-legacy", "-o", "x.safetensors"), "give a path ending in .pt"),
    (("export", f"{TINY}:make_task", "-p", "int9", "-o", "x.safetensors"), "unknown policy 'int9'"),
    (("export", f"{TINY}:make_task", "-p", "bf16", "-o", "/proc/x.safetensors"), "cannot write /proc/x.safetensors"),
    # output paths are checked before the run whose result they are to hold
    (("tune", f"{TINY}:make_task", "-o", "/proc/plan.json"), "cannot write /proc/plan.json"),
    (("tune", f"{TINY}:make_task", "--mode", "train", "--json", "/proc/t.json"), "cannot write /proc/t.json"),
    (("tune", f"{TINY}:make_task", "-o", "/"), "cannot write /: it is a folder"),
    (("audit", f"{TINY}:make_task", "--json", "/proc/a.json"), "cannot write /proc/a.json"),
    (("trace", f"{TINY}:make_task", "--json", "/proc/t.json"), "cannot write /proc/t.json"),
    (("autopilot", f"{TINY}:make_task", "--json", "/proc/a.json"), "cannot write /proc/a.json"),
    (("autopilot", f"{TINY}:make_task", "--plan-out", "/"), "cannot write /: it is a folder"),
    (("autopilot", f"{TINY}:make_task", "-s", "amp-bf16", "--promote-to", "fp8"),
     "promote_to: must be one of 'auto', 'fp32', 'bf16' or 'amp-bf16', got 'fp8' (--promote-to)"),
    (("autopilot", f"{TINY}:make_task", "--sample-every", "0"), "sample"),
    (("autopilot", SCRIPT, "-s", "int8-dyn"), "policy int8-dyn is inference-only"),
    (("autopilot", f"{TINY}:make_task", "--", "--epochs", "1"), "arguments after -- are for a training script"),
    (("bench", f"{TINY}:make_task", "-p", "fp32", "--json", "/proc/b.json"), "cannot write /proc/b.json"),
    (("bench", f"{TINY}:make_task", "--hardware", "nowhere.json"), "no such hardware file: nowhere.json"),
    (("tune", f"{TINY}:make_task", "--hardware", TINY), "cannot read hardware file"),
    # a training script is refused, without being run, by the commands that need a task
    (("tune", SCRIPT), "defines no make_task: it is a training script"),
    (("export", SCRIPT, "-p", "bf16", "-o", "x.safetensors"), "defines no make_task: it is a training script"),
    # a misspelt flag before -- is not taken for a script's argument (which only follow --)
    (("bench", f"{TINY}:make_task", "--log", "x.txt"), "no such option: --log (a training script's own arguments"),
    (("bench", SCRIPT, "--epochs", "1", "--", "--epochs", "1"), "no such option: --epochs"),
    (("trace", SCRIPT, "stray"), "unexpected argument: stray"),
])
def test_user_mistakes_get_one_line_and_nonzero_exit(args, message):
    """In this process through click's test runner (the same app, error handling and stderr; a subprocess each
    would cost ~3 s of interpreter and torch start-up per case): the next test runs some of them as a user would."""
    from typer.testing import CliRunner

    from dtypelab.cli import app

    run = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert run.exit_code == 2, (run.stderr, run.exception)
    assert message in run.stderr
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr


def test_user_mistakes_in_a_real_process_are_one_line_too():
    for args, message in ((("bench", "missing.py:make_task"), "task file not found: missing.py"),
                          (("trace", SCRIPT, "stray"), "unexpected argument: stray")):
        run = dtypelab(*args)
        assert run.returncode == 2 and message in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr


def test_a_disturbed_probe_leaves_a_user_mistake_one_line(tmp_path):
    """The 'probe was disturbed' notice once came before the error, making it two lines."""
    from dataclasses import replace

    from conftest import fake_hardware, hardware_file

    busy = hardware_file(tmp_path, replace(fake_hardware(), disturbed="other processes used 0.96 of a core"))
    for args, message in ((("--policies", "tf32"), "policy tf32 cannot run here"),
                          (("-p", "fp32", "--json", "/proc/b.json"), "cannot write /proc/b.json")):
        run = dtypelab("bench", f"{TINY}:make_task", *args, "--hardware", busy)
        assert run.returncode == 2 and message in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr


def test_a_saved_probe_is_what_bench_decides_with(tmp_path):
    saved = tmp_path / "hw.json"
    shown = dtypelab("hardware", "--json", str(saved))
    assert shown.returncode == 0 and "float32" in shown.stdout and saved.exists()
    hw = json.loads(saved.read_text())
    assert hw["gflops"]["float32"] > 0 and hw["device"] == "cpu"
    from conftest import avx2_hardware, hardware_file

    # the AVX2 EPYC's figures: bf16 is skipped as slow without running, whatever this CPU
    slow = hardware_file(tmp_path, avx2_hardware())
    out = tmp_path / "r.json"
    run = dtypelab("bench", f"{TINY}:make_task", "-p", "fp32,bf16", "--steps", "6", "--rounds", "0", "--json",
                   str(out), "--hardware", slow)
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    assert record["environment"]["hardware"]["device_name"] == "AMD EPYC"
    assert [r["status"] for r in record["results"]] == ["ok", "skipped"]


def test_a_raising_task_shows_the_users_traceback_only():
    run = dtypelab("bench", f"{TINY}:make_broken_task")
    assert run.returncode == 2
    assert "the user's own bug" in run.stderr and "helper_that_fails" in run.stderr
    assert "Traceback" not in run.stderr and "dtypelab/task.py" not in run.stderr


@pytest.mark.slow
def test_inference_mode_end_to_end(tmp_path):
    out = tmp_path / "infer.json"
    run = dtypelab("bench", f"{TINY}:make_task", "--mode", "infer", "--policies", "fp32,bf16", "--steps", "5",
                   "--force", "--json", str(out))  # --force: bf16 is refused as slow on CPUs without bf16
    assert run.returncode == 0, run.stderr
    assert "latency ms" in run.stdout and "SQNR dB" in run.stdout
    bf16 = json.loads(out.read_text())["results"][1]
    assert bf16["policy"] == "bf16" and 20 < bf16["fidelity"]["sqnr_db"] < 60


def test_export_writes_reloads_and_reports_size(tmp_path):
    path = tmp_path / "tiny-int8.safetensors"
    run = dtypelab("export", f"{TINY}:make_task", "--policy", "int8-dyn", "-o", str(path))
    assert run.returncode == 0, run.stderr
    assert path.is_file() and "x fp32" in run.stdout and "reloaded from the file: outputs identical" in run.stdout
    from dtypelab import load_exported

    model, meta = load_exported(str(path), task=f"{TINY}:make_task")
    assert meta["policy"] == "int8-dyn" and type(model.net[0].weight).__name__ == "Int8Tensor"


def test_python_dash_m_dtypelab_runs_the_cli():
    run = subprocess.run([sys.executable, "-m", "dtypelab", "formats", "-v", "0.1", "-f", "bf16", "--format", "json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    stored = {row["format"]: row["stored"] for row in json.loads(run.stdout)}
    assert stored["bfloat16"] == float(torch.tensor(0.1, dtype=torch.bfloat16)) == 0.10009765625


def test_readme_commands_are_what_ci_runs():
    root = os.path.join(os.path.dirname(TINY), "..")
    with open(os.path.join(root, "README.md")) as f:
        commands = [line[6:] for line in f.read().splitlines() if line.startswith("    $ ")]
    assert len(commands) == 2
    assert commands[0].endswith("dtypelab bench digits") and "pip install -c constraints.txt" in commands[0]
    # CI runs these paths
    # the suite in a worker per CPU (tests/conftest.py)
    parallel = "pytest -n auto"
    assert commands[1].endswith(parallel) and ".[test,docs,minilm,lightning,hf,finetune,quantize,device]" in commands[1]
    assert "lint-imports" in commands[1] and "mkdocs build --strict" in commands[1]  # layering and docs, checked
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = f.read()
    assert "sed -n 2p" in ci  # .ci/run executes the second README command verbatim
    with open(os.path.join(root, "README.md")) as f:
        assert len(f.read().splitlines()) <= 200  # a front page: the samples live in the guide
    # and the end-to-end step alike, then its validation gate (its runner parallel on its own)
    e2e = parallel.replace("pytest", 'pytest -m "e2e and not validation"')
    assert f"python -m {e2e} " in ci
    assert "python -m pytest -m validation " in ci


def test_policies_command_says_what_runs_on_the_probed_hardware(tmp_path):
    """The 'here' column follows the probe: float16 measured at 0.5 GFLOP/s is skipped unless forced, at 200 it
    runs; tf32 is never a CPU mode."""
    rows = {}
    for gflops in (0.5, 200.0):
        probe_file = hardware_file(tmp_path, fake_hardware(fp16_gflops=gflops))
        run = dtypelab("policies", "--device", "cpu", "--hardware", probe_file)
        assert run.returncode == 0, run.stderr
        rows[gflops] = {cells[1].strip(): cells[3].strip() for line in run.stdout.splitlines()
                        if len(cells := line.split("│")) == 5 and cells[1].strip()}
    assert rows[0.5]["fp16"].startswith("skipped unless --force:") and "0.5" in rows[0.5]["fp16"]
    assert rows[200.0]["fp16"] == rows[200.0]["amp-fp16"] == "runs"
    assert rows[0.5]["tf32"] == rows[200.0]["tf32"] and rows[0.5]["tf32"].startswith("not here:")


def test_nothing_imports_the_cli():
    src = os.path.join(os.path.dirname(TINY), "..", "src", "dtypelab")
    for root, _, files in os.walk(src):
        if os.path.basename(root) == "cli":
            continue
        for f in files:
            if f == "__main__.py" and os.path.samefile(root, src):
                continue  # `python -m dtypelab`: an entry point, like the console script, not library code
            if f.endswith(".py"):
                with open(os.path.join(root, f)) as fh:
                    text = fh.read()
                assert "from .cli" not in text and "dtypelab.cli" not in text and "from ..cli" not in text, f


def test_formats_table_and_values():
    run = dtypelab("formats")
    assert run.returncode == 0, run.stderr
    for text in ("float8_e4m3fn", "65504", "448", "tf32", "int4", "native on cpu"):
        assert text in run.stdout
    run = dtypelab("formats", "--value", "0.1", "--value", "65520", "--value", "1e-8", "-f", "fp16,bf16,int8")
    assert run.returncode == 0, run.stderr
    assert "overflow → inf" in run.stdout and "flushed to zero" in run.stdout and "0 | 01011 | 1001100110" in run.stdout
    js = json.loads(dtypelab("formats", "-v", "65520", "-f", "fp16", "--format", "json").stdout)
    assert js[0]["outcome"] == "overflow_inf"


def test_cast_a_checkpoint(tmp_path):
    import torch

    torch.save({"w": torch.randn(10) * 1e5, "b": torch.zeros(3)}, tmp_path / "ck.pt")
    run = dtypelab("cast", str(tmp_path / "ck.pt"), "--to", "fp16")
    assert run.returncode == 0, run.stderr
    assert "total" in run.stdout and "SQNR dB" in run.stdout and "-inf" in run.stdout
    js = json.loads(dtypelab("cast", str(tmp_path / "ck.pt"), "--to", "fp16", "--format", "json").stdout)
    assert js["total"]["counts"]["overflow_inf"] > 0 and js["total"]["sqnr_db"] == "-Infinity"


def test_audit_then_show(tmp_path):
    out = tmp_path / "audit.json"
    task = TINY + ":make_audit_task"
    run = dtypelab("audit", task, "--steps", "3", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "overflow risk" in run.stdout and "float16 loss scale" in run.stdout
    assert json.loads(out.read_text())["schema"] == "dtypelab.audit"
    shown = dtypelab("show", str(out), "--format", "markdown")
    assert shown.returncode == 0 and "| boom | act | Scale |" in shown.stdout and "max \\|x\\|" in shown.stdout


def test_audit_of_a_failing_model_shows_what_it_measured_and_exits_1(tmp_path):
    run = dtypelab("audit", f"{TINY}:make_raising_task", "--policy", "bf16", "--steps", "2", "--force",
                   "--json", str(tmp_path / "a.json"))
    assert run.returncode == 1
    assert "planted failure" in run.stderr and "Traceback" not in run.stderr
    assert json.loads((tmp_path / "a.json").read_text())["status"] == "failed"


def test_bench_takes_a_plan_file_and_bad_plans_are_one_line_errors(tmp_path):
    plan = tmp_path / "head32.json"
    plan.write_text(json.dumps({"default": "amp-bf16", "rules": {"net.2": "fp32"}}))
    out = tmp_path / "r.json"
    run = dtypelab("bench", f"{TINY}:make_task", "--policies", f"fp32,{plan}", "--steps", "4", "--force",
                   "--json", str(out), "--format", "markdown")
    assert run.returncode == 0, run.stderr
    assert "| head32 | ok |" in run.stdout
    saved = json.loads(out.read_text())["results"][1]
    assert saved["info"]["plan"]["rules"] == [{"pattern": "net.2", "config": {"kind": "cast", "dtype": "float32"}}]
    plan.write_text(json.dumps({"default": "amp-bf17"}))
    run = dtypelab("bench", f"{TINY}:make_task", "--policies", str(plan), "--steps", "2")
    assert run.returncode == 2 and "unknown policy 'amp-bf17'" in run.stderr and "Traceback" not in run.stderr


def test_the_suites_workers_see_the_real_terminal_and_take_a_share_of_the_cores(tmp_path):
    """`pytest -n auto`: each worker once saw COLUMNS=80 (set by pytest-xdist), so the commands the tests ran printed
    80-column tables and nine tests failed; and two workers at torch's default thread count would spin against each
    other."""
    from conftest import with_project_hooks

    tests = tmp_path / "tests"
    with_project_hooks(tests, "pytest_configure", "pytest_configure_node", "pytest_xdist_auto_num_workers")
    (tests / "test_x.py").write_text(
        "import os, torch\n"
        "def test_a():\n"
        "    print('SEEN', os.environ.get('COLUMNS'), os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n"
        "    assert False\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "-n", "2", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    from conftest import usable_cpus

    share = str(max(1, usable_cpus() // 2))
    assert f"SEEN None {share} {share}" in done.stdout, done.stdout[-2000:]


def test_a_file_shared_by_the_suites_workers_is_made_once(tmp_path_factory):
    """`made_once` (a fixture's costly record, e.g. the DDP sweep): callers at the same moment, as two workers are,
    get one file that one of them made."""
    import threading
    import time
    import uuid

    from conftest import made_once

    made, got = [], []

    def make(path: str) -> None:
        made.append(path)
        time.sleep(0.3)  # the other caller arrives while this one is still making it
        with open(path, "w") as f:
            f.write("x")

    name = f"shared-{uuid.uuid4().hex}.txt"
    tmp_path_factory.getbasetemp()  # made before the threads, as a session's is before its workers' fixtures
    callers = [threading.Thread(target=lambda: got.append(made_once(tmp_path_factory, name, make))) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    with open(made[0]) as f:
        assert len(made) == 1 and got == [made[0]] * 2 and f.read() == "x"


def test_bench_help_names_every_kind_of_task():
    got = dtypelab("bench", "--help")
    said = " ".join(got.stdout.split())
    for task in ("hf:ORG/NAME", "minilm-ft", "tinylm", "digits", "train.py"):
        assert task in said
