"""--profile: FLOP counts, the step breakdown, dtype coverage, planted float64, the record and its tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import dtypelab
from dtypelab.core.judging import why
from dtypelab.profiling.collect import tally

PT = os.path.join(os.path.dirname(__file__), "profile_tasks.py")


def _flops(fn) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    units = tally(list(prof.events()), cuda=False).units
    out: dict[str, float] = {}
    for (name, *_), u in units.items():
        if u.flops:
            out[name] = out.get(name, 0) + u.flops
    return out


def test_flop_counts_match_hand_computed_values():
    lin, x = nn.Linear(32, 16), torch.randn(8, 32)
    assert _flops(lambda: lin(x)) == {"aten::addmm": 2 * 8 * 32 * 16}
    conv, img = nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.randn(4, 3, 9, 9, requires_grad=True)
    forward = 2 * 4 * 8 * (5 * 5) * 3 * 9  # output 5×5: (9 + 2 - 3) // 2 + 1
    assert _flops(lambda: conv(img)) == {"aten::convolution": forward}
    # backward: the input's and the weight's gradients, each a convolution of the forward's size
    assert _flops(lambda: conv(img).sum().backward())["aten::convolution_backward"] == 2 * forward
    a, b = torch.randn(2, 4, 5), torch.randn(2, 5, 3)
    assert _flops(lambda: torch.bmm(a, b)) == {"aten::bmm": 2 * 2 * 4 * 5 * 3}
    # a matmul inside another counted op is not counted twice; an elementwise op has none
    assert _flops(lambda: torch.relu(a)) == {}


def test_phases_add_up_to_the_step_and_categories_cover_it():
    p = dtypelab.profile("digits", "fp32", steps=3, warmup=3, device="cpu")
    assert not p.error and p.steps == 3
    assert set(p.phases) == {"data", "forward", "backward", "optimizer"}
    assert sum(p.phases.values()) == pytest.approx(p.step_s, rel=0.05)
    assert sum(p.categories.values()) == pytest.approx(p.step_s, rel=1e-6)
    assert p.categories["matmul"] > 0 and p.matmul_flops > 0 and p.utilisation > 0
    assert p.bound in ("compute", "memory", "overhead") and p.timed_step_s > 0
    conv = next(o for o in p.ops if o.name == "aten::convolution")
    assert conv.dtypes == "float32" and conv.gflops > 0 and conv.peak_gflops > 0
    assert p.dtype_time and max(p.dtype_time, key=p.dtype_time.get) == "float32"
    assert not p.fp64_ops  # Adam's 0-dim float64 scalars are no float64 work


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="torch 2.11's autograd rejects the float32 × float64 mul's backward (seen on the H100)")
def test_planted_float64_promotion_is_found_with_its_source_line():
    p = dtypelab.profile(f"{PT}:fp64_task", "fp32", steps=2, warmup=2, device="cpu")
    assert p.fp64_ops and p.dtype_flops.get("float64", 0) > 0
    with open(PT) as f:
        line = next(i for i, text in enumerate(f, 1) if "# PLANTED" in text)
    site = next(s for s in p.fp64_sources if s.source.endswith(f"profile_tasks.py:{line}"))
    assert "torch.from_numpy" in site.code and site.op == "aten::mul" and "float32" in site.why
    # a policy that asks for float64 is not warned about it
    assert not dtypelab.profile(f"{PT}:fp64_task", "fp64", steps=2, warmup=2, device="cpu").fp64_ops


def test_autocast_coverage_and_float32_by_design(monkeypatch):
    # where bf16 matmuls are not native they take nearly the whole step, and the loss falls under the listing share:
    # list every op here, so that the classification itself is what is checked, whatever this CPU
    monkeypatch.setattr(sys.modules["dtypelab.profiling.summary"], "LISTED_SHARE", 0.0)
    p = dtypelab.profile(f"{PT}:wide_task", "amp-bf16", steps=3, warmup=2, device="cpu")
    assert p.dtype_flops and max(p.dtype_flops, key=p.dtype_flops.get) == "bfloat16"
    assert p.categories.get("cast", 0) > 0
    mse = next(o for o in p.fp32_under_autocast if "mse_loss" in o.op)
    assert "by design" in mse.why
    text = why("amp-bf16", p, dtypelab.profile(f"{PT}:wide_task", "fp32", steps=3, warmup=2, device="cpu"), 0.9)
    assert text.startswith("amp-bf16 is not faster than fp32 here (0.90x)") and "bound" in text


def test_a_broadcasting_loss_is_reported():
    p = dtypelab.profile(f"{PT}:broadcast_task", "fp32", steps=2, warmup=2, device="cpu")
    assert any("target size" in w for w in p.warnings)


def test_profile_restores_globals_for_every_policy():
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
              torch.get_num_threads(), torch.backends.cuda.matmul.fp32_precision)
    for policy in ("fp64", "bf16", "fp16", "amp-bf16", "amp-fp16"):
        dtypelab.profile(f"{PT}:wide_task", policy, steps=1, warmup=1, threads_n=1, device="cpu")
        after = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                 torch.get_num_threads(), torch.backends.cuda.matmul.fp32_precision)
        assert after == before, policy


def test_bad_profile_arguments_are_one_line_errors():
    with pytest.raises(dtypelab.DtypelabError, match="mode"):
        dtypelab.profile("digits", mode="eval", device="cpu")
    with pytest.raises(dtypelab.DtypelabError, match="at least 1"):
        dtypelab.profile("digits", steps=0, device="cpu")


@pytest.mark.slow
def test_bench_profile_cli_record_tables_and_traces(tmp_path, fast_bf16_env):
    def run_cli(*args: str) -> subprocess.CompletedProcess:
        from test_cli import dtypelab as in_process

        return in_process(*args, env=fast_bf16_env)

    out = tmp_path / "r.json"
    traces = tmp_path / "traces"
    r = run_cli("bench", "digits", "-p", "fp32,amp-bf16", "--steps", "20", "--rounds", "0", "--trace-dir",
                str(traces), "--json", str(out), "--format", "markdown")
    assert r.returncode == 0, r.stderr
    assert "Where the step goes" in r.stdout and "Top ops per policy" in r.stdout
    assert "Why: amp-bf16" in r.stdout
    assert sorted(os.listdir(traces)) == ["amp-bf16.trace.json", "fp32.trace.json"]
    assert json.loads((traces / "fp32.trace.json").read_text())["traceEvents"]
    report = dtypelab.load_report(str(out))
    assert report.config.profile_steps == 5 and all(r.profile and not r.profile.error for r in report.results)
    assert dtypelab.load_report(str(out)) == report  # JSON round trip
    shown = run_cli("show", str(out))
    assert shown.returncode == 0 and "Where the step goes" in shown.stdout
    page = tmp_path / "page.html"
    assert run_cli("report", str(out), "-o", str(page)).returncode == 0
    assert "Where the step goes" in page.read_text()


def test_dtypes_come_from_kineto_where_events_lack_them():
    """torch 2.11's FunctionEvent has no input_dtypes: they are read from the Kineto events by id."""
    from dtypelab.profiling.collect import dtype_of, input_dtypes

    lin, x = nn.Linear(32, 16).to(torch.bfloat16), torch.randn(8, 32).to(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        lin(x)
    event = next(e for e in prof.events() if e.name == "aten::addmm")

    class Old:  # an event as torch 2.11 makes it
        def __getattr__(self, name):
            if name == "input_dtypes":
                raise AttributeError(name)
            return getattr(event, name)

    assert dtype_of(Old(), input_dtypes(prof)) == dtype_of(event, input_dtypes(prof)) == "bfloat16"
