"""The sweep: isolation (crash, hang, raise), shared initial weights, streaming to disk."""

from __future__ import annotations

import json

import pytest
from conftest import TINY

from dtypelab import DtypelabError, bench, load_report


@pytest.mark.slow
@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_a_failing_crashing_or_hanging_policy_does_not_stop_the_sweep(tmp_path, hw):
    out = tmp_path / "r.json"
    report = bench(f"{TINY}:make_raising_task", "fp32,bf16", steps=6, hardware=hw, json_path=str(out))
    assert report.result("fp32").status == "ok"
    bad = report.result("bf16")
    assert bad.status == "failed"
    assert "ValueError: planted failure under torch.bfloat16 (at tiny_task.py:" in bad.reason
    assert load_report(str(out)) == report

    crash = bench(f"{TINY}:make_crashing_task", "fp32,fp64", steps=6, hardware=hw)
    assert crash.result("fp64").status == "failed" and "SIGSEGV" in crash.result("fp64").reason
    assert crash.result("fp32").status == "ok"

    hang = bench(f"{TINY}:make_hanging_task", "fp32,bf16", steps=6, hardware=hw, timeout_s=8)
    assert hang.result("bf16").status == "timeout" and "8 s time limit" in hang.result("bf16").reason


@pytest.mark.slow
def test_isolated_sweep_shares_initial_weights_and_streams_results(tmp_path, hw, tiny):
    out = tmp_path / "r.json"
    snapshots = []

    def on_event(e):
        if e.kind == "done":
            snapshots.append([r["policy"] for r in json.loads(out.read_text())["results"]])

    report = bench(tiny, ["bf16", "amp-bf16"], steps=12, hardware=hw, json_path=str(out), on_event=on_event)
    assert [r.policy for r in report.results] == ["fp32", "bf16", "amp-bf16"]  # baseline added, first
    prints = {r.init_fingerprint for r in report.results}
    assert len(prints) == 1 and prints != {""}
    # the file already held each policy's result when its 'done' event fired
    assert snapshots == [["fp32"], ["fp32", "bf16"], ["fp32", "bf16", "amp-bf16"]]
    for r in report.results:
        assert r.status == "ok" and len(r.step_times_s) == 12 and len(r.losses) == 12
        assert r.peak_memory_bytes is not None and r.model_bytes > 0


def test_same_data_and_weights_give_identical_fp32_runs(hw, tiny):
    a = bench(tiny, "fp32", steps=8, hardware=hw, isolate=False).result("fp32")
    b = bench(tiny, "fp32", steps=8, hardware=hw, isolate=False).result("fp32")
    assert a.losses == b.losses and a.metrics == b.metrics


def test_slow_policies_are_skipped_with_the_measured_reason_unless_forced(hw, tiny):
    report = bench(tiny, "fp32,fp16", steps=4, hardware=hw, isolate=False)
    fp16 = report.result("fp16")
    assert fp16.status == "skipped" and "GFLOP/s" in fp16.reason
    forced = bench(tiny, "fp32,fp16", steps=4, hardware=hw, isolate=False, force=True)
    assert forced.result("fp16").status in ("ok", "diverged")


def test_default_sweep_lists_inapplicable_policies_as_skipped(hw, tiny):
    report = bench(tiny, steps=4, hardware=hw, isolate=False)
    assert [r.policy for r in report.results] == ["fp64", "fp32", "tf32", "bf16", "fp16", "amp-bf16", "amp-fp16"]
    assert report.result("tf32").status == "skipped" and "CUDA" in report.result("tf32").reason


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policies": "tf32"}, "policy tf32 cannot run here"),
    ({"policies": "fp33"}, "did you mean 'fp32'"),
    ({"tolerance": "one%"}, "bad tolerance"),
    ({"steps": 0}, "steps: must be at least 1, got 0 (--steps)"),
    ({"steps": 5, "warmup": 5}, "--warmup (5) must be smaller than --steps (5)"),
    ({"mode": "serve"}, "mode: must be one of 'train', 'infer' or 'generate', got 'serve' (--mode)"),
    ({"device": "tpu"}, "invalid device 'tpu'"),
])
def test_bad_arguments(kwargs, message, hw, tiny):
    with pytest.raises(DtypelabError) as info:
        bench(tiny, hardware=hw, isolate=False, **kwargs)
    assert message in str(info.value)


def test_inference_mode_measures_fidelity_against_fp32(hw, tiny):
    report = bench(tiny, "fp32,bf16,fp64", mode="infer", steps=5, hardware=hw, isolate=False)
    fp32, bf16, fp64 = (report.result(n) for n in ("fp32", "bf16", "fp64"))
    assert fp32.fidelity["sqnr_db"] == float("inf") and fp32.fidelity["max_abs_err"] == 0
    assert 20 < bf16.fidelity["sqnr_db"] < 60  # bf16 keeps ~8 bits: ~40 dB on a small MLP
    assert fp64.fidelity["sqnr_db"] > 100
    assert bf16.model_bytes < 0.6 * fp32.model_bytes
    assert not fp32.losses and len(fp32.step_times_s) == 5


def test_ctrl_c_keeps_finished_results_on_disk(tmp_path, hw, tiny):
    out = tmp_path / "r.json"

    def on_event(e):
        if e.kind == "done" and e.policy == "fp32":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench(tiny, "fp32,bf16,amp-bf16", steps=5, hardware=hw, isolate=False, json_path=str(out), on_event=on_event)
    saved = load_report(str(out))
    assert saved.result("fp32").status == "ok" and len(saved.result("fp32").losses) == 5
    assert [saved.result(n).status for n in ("bf16", "amp-bf16")] == ["interrupted", "interrupted"]


@pytest.mark.slow
@pytest.mark.e2e  # a whole process end to end: CI's second step
def test_bench_runs_from_a_script_on_stdin(tiny):
    """Children must not re-import the parent's __main__ (multiprocessing's spawn would, and fail)."""
    import subprocess
    import sys

    code = f"import dtypelab\nr = dtypelab.bench({tiny!r}, 'fp32', steps=3)\nprint(r.result('fp32').status)\n"
    run = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
