"""forecast: each policy's peak memory traced on fake tensors from one step, checked against the same steps run for
real (the same ledger on real tensors, and torch's own MemTracker); the 7B arithmetic; the largest batch against
brute force; stand-ins and fallbacks; FSDP's shards; one-line errors; the record."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from conftest import HERE, TINY, interruptible

import dtypelab
from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import get_policy
from dtypelab.core.records import load_record

TASKS = os.path.join(HERE, "forecast_tasks.py")
GB = 1e9


def forecast(task: str, **settings):
    settings.setdefault("launcher", "inline")
    return dtypelab.forecast(task, **settings)


# --- the count itself -----------------------------------------------------------------------------------------------
def test_the_ledger_on_real_tensors_counts_what_torchs_memtracker_counts():
    """An independent count: torch's MemTracker (torch.distributed._tools.mem_tracker) over the same real steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from dtypelab.core.loop import build_trainable, train_step
    from dtypelab.core.policies import Precision, get_policy
    from dtypelab.core.task import load_task

    task = load_task("gpt2")
    for name in ("fp32", "amp-bf16"):
        plan = get_policy(name)
        report = forecast("gpt2", policies=name, device="cpu", check=True, batch_search=False, batch_size=4,
                          speed=False)
        ours = report.result(name).check.train_peak_bytes
        precision = Precision(plan, "cpu")
        model, optimizer = build_trainable(task, precision, torch.device("cpu"))
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with precision.session(), tracker:
            for step in range(3):
                inputs, target = task.batch(step, 4)
                train_step(task, model, precision, optimizer, inputs.clone(), target.clone())
                tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
        theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        assert abs(ours - theirs) <= 0.002 * theirs, (name, ours, theirs)


@pytest.mark.parametrize("task,policies,batch", [
    ("digits", "fp32,bf16,bf16-kahan,bf16-sr+adam8bit,int8-wo", 64),
    ("gpt2", "fp32,amp-bf16,amp-bf16+adam8bit", 4),
    ("decoder", "fp32,bf16", 4),
])
def test_one_traced_step_forecasts_the_peak_of_the_steps_run_for_real(task, policies, batch):
    """Traced once on fake tensors, every later step derived (the optimizer's state alive through the forward and
    backward): against three real steps counted by the same ledger, within 1% (the acceptance bar is 10%; the
    benchmark benchmarks/forecast.py checks more models, policies and sizes). Small batches: a real bf16 step is
    ~100x slower on a CPU without bf16 arithmetic."""
    report = forecast(task, policies=policies, device="cpu", check=True, batch_search=False, batch_size=batch,
                      speed=False)
    assert report.speed_answer.startswith("--no-speed: memory alone, no time is forecast")
    for p in report.policies:
        assert p.time is None  # --no-speed: memory alone, and the answer says so
        assert p.status == "ok", (p.policy, p.reason)
        # a training policy is compared in training and inference, an inference-only one (int8-wo) in inference
        pairs = [(p.infer, p.check.infer_peak_bytes), *([(p.train, p.check.train_peak_bytes)] if p.train else [])]
        assert p.infer is not None and (p.train is not None) == ("train" in get_policy(p.policy).modes)
        for forecast_peak, measured in pairs:
            assert measured, (task, p.policy)
            assert abs(forecast_peak.peak_bytes / measured - 1) < 0.01, (task, p.policy, forecast_peak, measured)
        if p.train is not None:
            assert sum(p.train.breakdown.values()) == p.train.peak_bytes


def test_what_each_category_holds_is_exact():
    """fp32 AdamW: the state is two moments per weight plus a step per tensor; bf16 halves the weights; Kahan's
    compensation is one bf16 copy; frozen weights have no gradient and no state."""
    report = forecast("digits", policies="fp32,bf16,bf16-kahan", device="cpu", batch_search=False, speed=False)
    fp32, bf16, kahan = (report.result(n).train for n in ("fp32", "bf16", "bf16-kahan"))
    params = report.config.parameters
    assert fp32.parameter_bytes == 4 * params and bf16.parameter_bytes == 2 * params
    tensors = 8  # digits: 4 layers with weight and bias
    assert fp32.breakdown["optimizer_state"] == 8 * params + 4 * tensors
    assert kahan.breakdown["master_weights"] == 2 * params
    frozen = forecast(f"{TASKS}:frozen", policies="fp32", device="cpu", batch_search=False,
                      speed=False).result("fp32").train
    head = 256 * 2 + 2
    assert frozen.breakdown["optimizer_state"] == 8 * head + 4 * 2


# --- where it cannot be run -------------------------------------------------------------------------------------------
def test_a_7b_decoder_from_its_shape_alone_the_arithmetic_and_the_verdict():
    """Llama-2-7B's shape on the meta device: its parameters exact; fp32 weights, gradients and AdamW's two moments
    are 16 bytes per parameter (107.8 GB); on an H100 the update also holds foreach's intermediates: no fit."""
    report = forecast("llama2-7b", policies="fp32", device="H100", batch_search=False)
    n = 6_738_415_616
    assert report.config.parameters == n
    peak = report.result("fp32").train
    b = peak.breakdown
    assert peak.parameter_bytes == 4 * n
    steps = 32 * 9 + 3  # a step tensor per parameter tensor (9 a layer, embedding, norm, head), 512 bytes on CUDA
    assert b["parameters"] + b["gradients"] + b["optimizer_state"] == 16 * n + 512 * steps
    assert round((16 * n) / GB, 1) == 107.8
    assert peak.phase == "optimizer" and b["temporaries"] >= 4 * n  # foreach: one more copy while it updates
    fit = report.result("fp32").train_fit
    assert not fit.fits and fit.headroom_bytes < 0
    assert report.answer.startswith("Training fits nowhere on NVIDIA H100 80GB")


def test_nothing_fitting_anywhere_is_an_answer_not_an_error():
    report = forecast("llama2-7b", policies="fp32", batch_size=8, batch_search=False)
    assert report.result("fp32").smallest_device == ""
    assert report.answer.startswith("Training fits nowhere in the table (the largest, NVIDIA H200")
    assert "smallest peak: fp32 at" in report.answer


def test_gpu_only_formats_are_forecast_with_stand_ins_of_their_layout():
    """fp8 and int4 inference need CUDA to convert: traced with a bfloat16 cast in their place, the converted
    weights counted by torchao's layouts; mxfp4 (Blackwell kernels) traced as its emulation, which stores the same."""
    report = forecast("gpt2", policies="bf16,int4-wo,fp8-dyn-row,mxfp4-dyn,mxfp4-dyn-emu,fp8-tensorwise",
                      device="H100", batch_search=False)
    by = {p.policy: p for p in report.policies}
    assert all(p.status == "ok" for p in by.values()), [(p.policy, p.reason) for p in by.values()]
    assert {n: by[n].method for n in ("int4-wo", "fp8-dyn-row")} == dict.fromkeys(("int4-wo", "fp8-dyn-row"),
                                                                                  "stand-in")
    # torch 2.13 cannot convert mxfp4 here (a stand-in); 2.11 can (traced): either way it stores what its emulation does
    assert by["mxfp4-dyn"].method in ("stand-in", "traced")
    assert by["mxfp4-dyn"].infer.parameter_bytes == by["mxfp4-dyn-emu"].infer.parameter_bytes
    assert by["mxfp4-dyn"].runs_there.startswith("mxfp4 inference runs MX tensor-core matmuls")
    # gpt2 (reduced): 2 blocks of 4 Linear layers (qkv 64->192, proj, mlp 64->256, 256->64) and the tied head
    # 64->512. int4 takes the layers whose input width is a multiple of 128 (whole groups) and outputs of 8 (here
    # the two 256->64), pads their input width to 1024, and keeps a bf16 scale and zero per 128 inputs per output.
    shapes = [(n, k) for n, k in [(192, 64), (64, 64), (256, 64), (64, 256)] * 2 + [(512, 64)]
              if k % 128 == 0 and n % 8 == 0]
    assert shapes == [(64, 256), (64, 256)]
    int4 = sum(n * (-(-k // 1024) * 1024) // 2 + (-(-k // 1024) * 1024 // 128) * n * 4 for n, k in shapes)
    bf16 = sum(2 * n * k for n, k in shapes)
    blocks = 512 * len(shapes)  # each converted layer's layout counted as one more 512-byte block on CUDA
    assert by["int4-wo"].infer.parameter_bytes - by["bf16"].infer.parameter_bytes == int4 - bf16 + blocks


def test_an_untraceable_step_is_measured_here_and_extrapolated_or_else_state_only(monkeypatch):
    gated = f"{TASKS}:gated"
    p = forecast(gated, policies="fp32", device="cpu", batch_size=16, batch_search=False,
                 speed=False).result("fp32")
    assert p.status == "ok" and p.method == "measured" and p.train.activations_bytes > 0
    assert any("could not be traced on fake tensors" in n and "extrapolated" in n for n in p.notes), p.notes
    monkeypatch.setattr("dtypelab.forecasting.local_run.available_bytes", lambda: 0)  # as if far too big for here
    p = forecast(gated, policies="fp32", device="cpu", batch_search=False, speed=False).result("fp32")
    assert p.method == "state-only" and p.train.breakdown["activations"] == 0
    assert any("activations are not counted" in n for n in p.notes)
    # its state alone is a lower bound: it never fits, has no time, and the answer says so rather than "fits"
    report = forecast(gated, policies="fp32", device="H100", batch_search=False)
    p = report.result("fp32")
    assert p.untraced and p.train_fit is None and p.infer_fit is None and p.time.step_s is None
    assert "fit" not in report.answer.split(":")[0] and "no peak, fit or time" in report.answer
    assert report.fastest == "" and not report.speed_answer.startswith("Fastest")
    from dtypelab.render.forecast import forecast_doc

    _, headers, rows, _ = forecast_doc(report)
    peak = next(i for i, h in enumerate(headers) if h.startswith("train peak MiB"))  # its band may follow
    assert rows[0][headers.index("fits")] == "not traced" and rows[0][peak].startswith("≥")


# --- the largest batch ------------------------------------------------------------------------------------------------
def test_the_search_finds_what_brute_force_finds():
    """Peaks that are affine, rounded to blocks, flat where the update dominates, or steeper past a kink."""
    from dtypelab.forecasting.search import largest_batch

    rng = random.Random(0)
    for _ in range(600):
        fixed, slope, floor = rng.randint(0, 10**6), rng.randint(1, 10**4), rng.randint(0, 10**6)
        kink, steeper, block = rng.randint(1, 3000), rng.randint(0, 10**4), rng.choice((1, 512))
        step, start, limit = rng.choice((1, 2, 8)), rng.randint(1, 64), rng.randint(0, 5 * 10**7)

        def peak(b: int, fixed=fixed, slope=slope, kink=kink, steeper=steeper, floor=floor, block=block) -> int:
            v = max(fixed + slope * b + max(0, b - kink) * steeper, fixed + floor)
            return -(-v // block) * block

        found = largest_batch(peak, limit, start, step, cap=1 << 14)
        fitting = [b for b in range(step, (1 << 14) + 1, step) if peak(b) <= limit]
        assert found.largest == (max(fitting) if fitting else None)
        if found.largest is not None and not found.capped:
            assert found.traced[found.largest] <= limit < found.traced[found.largest + step]


def test_the_largest_batch_is_traced_to_fit_and_the_next_is_traced_not_to():
    report = forecast(f"{TINY}:make_task", policies="fp32", memory="8MB", reserve="0")
    p = report.result("fp32")
    largest = p.train_fit.largest_batch
    assert largest and p.train_fit.traces >= 2
    under = forecast(f"{TINY}:make_task", policies="fp32", memory="8MB", reserve="0", batch_size=largest,
                     batch_search=False).result("fp32")
    over = forecast(f"{TINY}:make_task", policies="fp32", memory="8MB", reserve="0", batch_size=largest + 1,
                    batch_search=False).result("fp32")
    assert under.train_fit.fits and not over.train_fit.fits


# --- several ranks ----------------------------------------------------------------------------------------------------
def test_fsdp_divides_what_it_shards_and_ddp_keeps_a_copy_of_the_gradients():
    one = forecast("charlm", policies="fp32", batch_search=False, batch_size=32).result("fp32").train
    four = forecast("charlm", nproc=4, policies="fp32+fsdp,fp32+ddp", batch_search=False, batch_size=32)
    fsdp, ddp = four.result("fp32+fsdp").train, four.result("fp32+ddp").train
    whole = one.parameter_bytes
    assert whole / 4 <= fsdp.parameter_bytes <= whole / 4 * 1.05  # padded to whole rows per rank, 512-byte blocks
    assert fsdp.breakdown["optimizer_state"] <= one.breakdown["optimizer_state"] / 4 * 1.05
    assert ddp.parameter_bytes == whole and ddp.breakdown["gradients"] >= one.parameter_bytes
    assert not torch.distributed.is_initialized()  # the fake process group is gone with the forecast


def test_globals_are_restored_after_a_forecast():
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
              torch.UntypedStorage.resize_, torch.get_num_threads())
    forecast("digits", policies="amp-bf16,bf16-sr+adam8bit,fp32+compile", batch_search=False)
    from torch._guards import active_fake_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.UntypedStorage.resize_, torch.get_num_threads()) == before
    assert active_fake_mode() is None and _get_current_dispatch_mode() is None
    assert not torch.distributed.is_initialized()


# --- the record, the CLI, mistakes ----------------------------------------------------------------------------------
def test_the_record_round_trips_and_renders(tmp_path):
    from dtypelab.render import report as page
    from dtypelab.render.forecast import forecast_doc

    path = tmp_path / "f.json"
    report = forecast("digits", policies="fp32,bf16,int4-wo", device="L4", json_path=str(path))
    loaded = load_record(str(path))
    assert loaded == report and json.loads(path.read_text())["schema"] == "dtypelab.forecast"
    title, headers, rows, notes = forecast_doc(loaded)
    assert "NVIDIA L4" in title and headers[-3:] == ["fits", "headroom MiB", "largest batch"]
    assert [r[0] for r in rows] == ["fp32", "bf16", "int4-wo"] and notes[0] == report.answer
    assert "<svg" in page([str(path)]).html


@pytest.mark.parametrize("args,message", [
    (("digits", "--device", "H10"), "unknown device 'H10' (did you mean H100?)"),
    (("digits", "--device", "A100"), "--device A100 is ambiguous: say A100-80GB or A100-40GB"),
    (("digits", "--memory", "24XB"), "bad memory size '24XB'"),
    (("digits", "--batch-size", "0"), "batch_size: must be at least 1"),
    (("digits", "--nproc", "3"), "the batch size 64 does not split over 3 ranks"),
    (("digits", "-p", "fp32+fsdp"), "fp32+fsdp runs across processes: give --nproc N"),
    (("digits", "-p", "fp33"), "unknown policy 'fp33'"),
    (("digits", "--device", "H100", "--check"), "--check runs the steps here (cpu)"),
    (("minilm", "-p", "fp32,bf16-sr"), "task minilm is inference-only: bf16-sr train"),
    ((os.path.join(HERE, "scripts", "real_script.py"),), "is a training script: forecast traces a task's step"),
    ((), "give a TASK"),
])
def test_mistakes_are_one_line(args, message):
    if torch.cuda.is_available() and "--check" in args:
        pytest.skip("--check runs on this CUDA machine")
    from typer.testing import CliRunner

    from dtypelab.cli import app

    run = CliRunner().invoke(app, ["forecast", *args], env={"COLUMNS": "200"})
    assert run.exit_code == 2, (run.stderr, run.exception)
    assert message in run.stderr and "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr


def test_the_command_prints_the_table_and_saves_the_record(tmp_path):
    from typer.testing import CliRunner

    from dtypelab.cli import app

    path = tmp_path / "f.json"
    run = CliRunner().invoke(app, ["forecast", "digits", "-p", "fp32,bf16", "--device", "T4", "--json", str(path)],
                             env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.stderr
    assert "bf16 cannot run on NVIDIA T4: bfloat16 needs compute capability >= 8.0 (this GPU is 7.5)" in run.stdout
    assert load_record(str(path)).result("bf16").runs_there
    listed = CliRunner().invoke(app, ["forecast", "--devices"], env={"COLUMNS": "200"})
    for name in ("H100", "H200", "H100-NVL", "A100-80GB", "A100-40GB", "L40S", "L4", "A10", "RTX4090"):
        assert f"│ {name} " in listed.stdout


def test_a_gpu_is_one_row_of_one_table(monkeypatch):
    """A card added as one ``DeviceSpec`` row is a --device, gives a lent card of its name its rates, and is listed
    with them: nothing else names it."""
    from dtypelab.core.machine import devices
    from dtypelab.core.machine.devices import DeviceSpec, device_spec, rated_peaks
    from dtypelab.render.forecast import devices_table

    row = DeviceSpec("B42", "NVIDIA B42", "99 GB HBM9", (10, 0), r"\bB42\b", {"float32": 7.5, "bfloat16": 1234.5},
                     nvml_mib=101376, aliases=("b42-99gb",), bandwidth_gbs=9000)
    monkeypatch.setattr(devices, "DEVICES", (*devices.DEVICES, row))
    assert device_spec("b42-99GB") is row and device_spec("NVIDIA B42") is row
    assert rated_peaks("NVIDIA B42") == ("NVIDIA B42 (NVIDIA datasheet, dense)", {"float32": 7.5, "bfloat16": 1234.5})
    _, headers, rows, _ = devices_table()
    listed = dict(zip(headers, next(r for r in rows if r[0] == "B42"), strict=True))
    assert (listed["usable GiB"], listed["bf16"], listed["fp8"], listed["memory GB/s"]) == ("98.45", "1234.5", "—",
                                                                                             "9000")


def test_a_bad_option_value_in_python_is_one_error():
    with pytest.raises(DtypelabError, match="nproc: must be at least 1"):
        dtypelab.forecast("digits", nproc=0)


def test_a_task_object_is_forecast_in_this_process():
    """Its functions are closures, which cannot travel to a worker; a trace on fake tensors needs no isolation."""
    from tiny_task import make_task

    report = dtypelab.forecast(make_task(), policies="fp32,bf16", device="L4", batch_search=False)
    assert report.config.task == "tiny" and all(p.status == "ok" for p in report.policies)
    with pytest.raises(DtypelabError, match="a Task object is forecast in this process"):
        dtypelab.forecast(make_task(), launcher="process")


def test_ctrl_c_keeps_the_policies_forecast_so_far_and_marks_the_rest_interrupted(tmp_path):
    """What the GPU check's time box relies on: Ctrl-C during a forecast saves the policies already forecast (the
    workers had reported them) and names the others interrupted; exit 130."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "f.json"
    proc = subprocess.Popen([sys.executable, "-m", "dtypelab", "forecast", "digits", "-p", "fp32,bf16,fp64,amp-bf16",
                             "--device", "cpu", "--check", "--no-speed", "--no-batch-search", "--json", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DTYPELAB_FORK": "0"}, preexec_fn=interruptible)
    seen, deadline = "", time.monotonic() + 120
    while "1/4 policies" not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    assert "1/4 policies" in seen, seen
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: the policies forecast so far are saved in" in " ".join(err.split())
    record = load_record(str(path))
    status = {p.policy: p.status for p in record.policies}
    assert status["fp32"] == "ok" and "interrupted" in status.values() and set(status) == {"fp32", "bf16", "fp64",
                                                                                             "amp-bf16"}
    assert record.config.parameters == 151306  # counted before the first policy (an H200 record said 0 parameters)


@pytest.mark.e2e  # torchrun with two ranks: CI's second step, with the other torchrun runs
@pytest.mark.parametrize("task", ["decoder", f"{TASKS}:nested"])
def test_fsdp_shards_each_repeated_block_and_the_forecast_equals_a_real_two_rank_run(task, tmp_path):
    """One FSDP2 unit per block, wherever the blocks sit (the decoder's top-level ModuleList; a list two levels
    down), then the root: the peak traced on fake tensors over a fake process group is the one a real 2-rank gloo run
    here holds, counted step by step on real tensors."""
    import subprocess
    import sys

    from dtypelab.core.task import load_task
    from dtypelab.distributed.wrap import fsdp_units

    model = load_task(task).make_model()
    units = fsdp_units(model)
    assert len(units) == 4 and len({type(u) for u in units}) == 1  # the blocks, not the top-level children
    out = tmp_path / "real.json"
    script = os.path.join(HERE, "scripts", "fsdp_peak.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, task, "8",
                          str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    real = json.loads(out.read_text())
    p = forecast(task, nproc=2, policies="fp32+fsdp", device="cpu", batch_size=8, batch_search=False,
                 speed=False).result("fp32+fsdp")
    assert p.status == "ok", p.reason
    assert p.train.peak_bytes == real["peak_bytes"] and p.train.breakdown == real["breakdown"]


def test_fsdp_units_are_the_repeated_blocks_wherever_they_sit_and_forecast_under_fsdp():
    from dtypelab.core.task import load_task
    from dtypelab.distributed.wrap import fsdp_units

    for task in ("decoder", f"{TASKS}:nested", "gpt2"):
        model = load_task(task).make_model()
        units = fsdp_units(model)
        assert len(units) >= 2 and len({type(u) for u in units}) == 1, task
        assert all(not any(u is v for v in model.children()) for u in units), task  # blocks, not the children
    p = forecast("decoder", nproc=2, policies="fp32+fsdp", batch_size=8, batch_search=False).result("fp32+fsdp")
    assert p.status == "ok", p.reason  # a top-level ModuleList once failed: fully_shard cannot take a container


def test_lora_targets_that_match_nothing_stop_the_forecast_before_any_trace():
    """Checked against the whole model (the 32 blocks of an 8B config, not the traced 3-block copy): one line, the
    layers counted as the model has them, nothing traced."""
    config = os.path.join(os.path.dirname(HERE), "benchmarks", "configs", "llama3-8b")
    with pytest.raises(DtypelabError, match=r"^--lora-targets q_projx matches none of the model's 225 Linear layers "
                                            r"\(their names end in q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                            r"down_proj, lm_head\)$"):
        dtypelab.forecast(f"hf:{config}", seq_len=512, policies="lora-bf16", lora_targets="q_projx", device="H100",
                          speed=False, launcher="inline")
