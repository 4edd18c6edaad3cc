"""The time model (core.machine.speed) against hand-computed cases, the ops a trace records (forecasting.ops), the
forecast's time per policy, its speedups, answer and record, the CPU self-check, and one-line refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import fake_hardware
from test_cli import dtypelab as run_cli
from torch.utils._python_dispatch import TorchDispatchMode

import dtypelab
from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.devices import device_spec
from dtypelab.core.machine.speed import (
    GEMM_EFFICIENCY,
    GPU_FLOOR_S,
    NoRate,
    Op,
    Rates,
    cpu_rates,
    fuse,
    gpu_rates,
    op_time,
    step_time,
)
from dtypelab.core.records import load_record
from dtypelab.forecasting.ops import record

FLAT = Rates("test", {"float32": 1e12, "bfloat16": 4e12, "fp8": 8e12}, bandwidth=1e11, floor_s=1e-6)


# --- the model's parts, by hand ---------------------------------------------------------------------------------------
def test_a_gemm_is_compute_bound_at_its_rate_and_memory_bound_when_thin():
    m = n = k = 4096
    square = Op("matmuls", "bfloat16", 2 * m * n * k, ((1, 2 * m * k), (2, 2 * k * n)), ((3, 2 * m * n),), m * n * k)
    t, bound = op_time(square, FLAT)
    assert bound == "compute" and t == pytest.approx(2 * m * n * k / 4e12)
    thin = Op("matmuls", "bfloat16", 2 * 1 * n * k, ((1, 2 * k), (2, 2 * k * n)), ((3, 2 * n),), n * k)
    t, bound = op_time(thin, FLAT)  # a matrix-vector product reads the whole weight for 2 FLOPs a weight
    assert bound == "memory" and t == pytest.approx((2 * k + 2 * k * n + 2 * n) / 1e11)
    tiny = Op("elementwise", "", 0, ((1, 8),), ((2, 8),))
    assert op_time(tiny, FLAT) == (1e-6, "overhead")


def test_the_gemm_efficiency_curve_is_read_between_its_points_and_keeps_small_gemms_at_the_floor():
    h100 = gpu_rates(device_spec("H100"))
    assert h100.efficiency(2.0**32) == pytest.approx(dict(GEMM_EFFICIENCY)[32])
    assert dict(GEMM_EFFICIENCY)[32] < h100.efficiency(2.0**32.5) < dict(GEMM_EFFICIENCY)[33]
    # below the table: the same time for less work (a launch-bound kernel)
    small, smallest = 2.0**20, 2.0**GEMM_EFFICIENCY[0][0]
    assert small / h100.efficiency(small) == pytest.approx(smallest / h100.efficiency(smallest))
    assert h100.flops["bfloat16"] == 989.5e12 and h100.bandwidth == pytest.approx(3350e9 * 0.92)
    assert h100.floor_s == GPU_FLOOR_S


def test_a_compiled_step_fuses_an_elementwise_chain_into_what_enters_and_leaves_it():
    # x -> a = x*2 -> b = a+1 -> c = relu(b); c is read by a matmul after the chain, a and b are not
    chain = [Op("elementwise", "", 0, ((1, 400),), ((2, 400),), fusible=True),
             Op("elementwise", "", 0, ((2, 400),), ((3, 400),), fusible=True),
             Op("elementwise", "", 0, ((3, 400),), ((4, 400),), fusible=True),
             Op("matmuls", "float32", 1e6, ((4, 400), (5, 400)), ((6, 400),), 5e5)]
    fused = fuse(chain)
    assert len(fused) == 2 and fused[1] is chain[3]
    assert (fused[0].read, fused[0].written) == (400, 400)  # x in, c out: a and b never leave the kernel
    eager, compiled = step_time(chain, FLAT), step_time(chain, FLAT, compiled=True)
    assert eager.kernels == 4 and compiled.kernels == 2 and compiled.step_s < eager.step_s
    # an in-place op inside the chain still reads what it updates from outside
    inplace = [Op("elementwise", "", 0, ((1, 100),), ((1, 100),), fusible=True),
               Op("elementwise", "", 0, ((1, 100),), ((2, 100),), fusible=True)]
    assert fuse(inplace)[0].read == 100


class Recorder(TorchDispatchMode):
    def __init__(self, phase: str = "forward") -> None:
        super().__init__()
        self.ops, self.phase = [], phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = record(func, args, kwargs or {}, out, self.phase)
        if op is not None:
            self.ops.append(op)
        return out


def test_the_ops_of_a_linear_layer_are_counted_as_torch_counts_them():
    x, w = torch.randn(32, 64), torch.randn(128, 64)
    with Recorder() as rec:
        y = torch.nn.functional.linear(x, w)
        y.t()  # a view: no kernel
        z = y.to(torch.bfloat16)
    mm = next(op for op in rec.ops if op.group == "matmuls")
    assert mm.flops == 2 * 32 * 64 * 128 and mm.rate == "float32" and mm.work == 32 * 64 * 128
    assert mm.read == (32 * 64 + 128 * 64) * 4 and mm.written == 32 * 128 * 4
    assert [op.group for op in rec.ops] == ["matmuls", "casts"]
    assert rec.ops[1].written == z.numel() * 2


def test_a_float8_scaling_op_is_a_cast_and_its_matmul_runs_at_the_fp8_rate():
    x = torch.randn(32, 64)
    with Recorder() as rec:
        scale = x.abs().amax() / 448.0
        x8 = (x / scale).to(torch.float8_e4m3fn)
    assert [op.group for op in rec.ops][-1] == "casts" and rec.ops[-1].written == x8.numel()
    a = Op("matmuls", "fp8", 2e9, work=1e9)
    assert op_time(a, FLAT)[0] == pytest.approx(2e9 / 8e12)
    with Recorder("optimizer") as rec:  # whatever an optimizer step runs counts as the optimizer's, unfused
        x.mul_(0.9)
    assert rec.ops[0].group == "optimizer" and not rec.ops[0].fusible


def test_a_heavy_call_is_kept_as_its_call_replayed_here_and_its_time_replaces_the_rate_model(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtypelab.forecasting import kernels

    x, w = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(128, 64, dtype=torch.bfloat16)
    with Recorder() as rec:
        torch.nn.functional.linear(x, w).relu()
    mm, relu = rec.ops
    assert mm.kernel[:2] == ("aten::mm", "default") and relu.kernel == ()  # only the heavy ops
    spec = mm.kernel[2][0]
    assert (spec.shape, spec.stride, spec.dtype, spec.nbytes) == ((32, 64), (64, 1), torch.bfloat16, 32 * 64 * 2)
    with FakeTensorMode() as fake, Recorder() as traced:  # a trace on fake tensors keeps the same call
        torch.nn.functional.linear(fake.from_tensor(x), fake.from_tensor(w))
    assert next(op for op in traced.ops if op.group == "matmuls").kernel == mm.kernel
    again = kernels.replay(mm.kernel)()
    assert again.shape == (32, 128) and again.dtype == torch.bfloat16
    done: dict = {}
    assert kernels.time_kernels([mm.kernel, mm.kernel, ()], done, budget_s=10) == (1, 0) and done[mm.kernel] > 0
    # the rate model is not asked: the call's own time (a floor still holds for a call faster than one op)
    slow = Rates("here", {}, 1e11, 1e-6, kernels={mm.kernel: 3e-3})
    assert op_time(mm, slow) == (3e-3, "compute")
    assert op_time(mm, replace(slow, floor_s=5e-3)) == (5e-3, "overhead")
    with pytest.raises(NoRate):  # without it, there is no bfloat16 rate to fall back on
        op_time(mm, replace(slow, kernels={}))
    monkeypatch.setattr(kernels, "MAX_BYTES", 1000)  # too large to make here: left to the rate model
    assert kernels.time_kernels([mm.kernel], {}, budget_s=10) == (0, 1)
    assert kernels.time_kernels([mm.kernel], {}, budget_s=-1) == (0, 1)  # the budget spent


def test_a_tensor_subclass_or_an_unknown_argument_is_not_replayed():
    from dtypelab.forecasting.kernels import signature

    class Odd(torch.Tensor):
        pass

    x = torch.randn(4, 4)
    assert signature(torch.ops.aten.mm.default, (x.as_subclass(Odd), x), {}) == ()
    assert signature(torch.ops.aten.mm.default, (x, object()), {}) == ()
    assert signature(torch.ops.aten.mm.default, (torch.nn.Parameter(x), x), {})


def test_a_cpu_forecast_times_each_heavy_call_here_and_adds_the_rest_by_the_model(monkeypatch):
    from dtypelab.forecasting import timing

    seen: list = []

    def every_call_a_millisecond(keys, done, budget_s):
        for key in keys:
            seen.append(key)
            done[key] = 1e-3
        return len(done), 0

    monkeypatch.setattr(timing, "time_kernels", every_call_a_millisecond)
    traced: list = []
    real_step_time = timing.step_time

    def kept(ops, rates, compiled=False):
        traced[:] = list(ops)  # the last time made: after every kernel was timed again
        return real_step_time(ops, rates, compiled)

    monkeypatch.setattr(timing, "step_time", kept)
    monkeypatch.setattr(timing, "retime", lambda done, budget_s: (1, None))  # the rounds keep the 1 ms
    report = dtypelab.forecast("digits", policies="fp32", device="cpu", batch_search=False, launcher="inline")
    t = report.result("fp32").time
    heavy = t.breakdown["matmuls"] + t.breakdown["convolutions"]
    calls = [op for op in traced if op.group in ("matmuls", "convolutions")]
    # every heavy call of the step was timed here (1 ms each), none by the model; the rest is the model's
    assert calls and all(op.kernel in seen for op in calls)
    assert heavy == pytest.approx(1e-3 * len(calls))
    assert t.breakdown["elementwise"] > 0 and t.step_s > heavy


def test_a_device_without_a_rate_for_a_policys_dtype_says_so_in_one_line():
    a100 = gpu_rates(device_spec("A100-80GB"))
    with pytest.raises(NoRate):
        op_time(Op("matmuls", "fp8", 1e9, work=5e8), a100)
    report = dtypelab.forecast("gpt2", policies="fp32,fp8-tensorwise-all-emu", device="A100-80GB",
                               batch_search=False, launcher="inline")
    assert report.result("fp32").time.step_s > 0
    emulated = report.result("fp8-tensorwise-all-emu").time  # numerics only: its kernels are not the real ones
    assert emulated.step_s is None and emulated.reason.startswith("emulated numerics")
    t4 = dtypelab.forecast("gpt2", policies="fp32,bf16", device="T4", batch_search=False, launcher="inline")
    bf16 = t4.result("bf16").time
    assert bf16.step_s is None and bf16.reason.startswith("no bfloat16 rate on NVIDIA T4")


# --- the forecast's time per policy -----------------------------------------------------------------------------------
def test_each_policy_gets_a_time_a_speedup_and_the_answer_names_the_fastest(tmp_path):
    path = tmp_path / "f.json"
    report = dtypelab.forecast("gpt2", policies="fp32,tf32,bf16,amp-bf16+compile", device="H100",
                               batch_search=False, launcher="inline", json_path=str(path))
    t = {p.policy: p.time for p in report.policies}
    assert report.baseline == "fp32" and t["fp32"].speedup == 1.0
    assert t["tf32"].step_s < t["fp32"].step_s  # the same trace, matmuls at tf32's rate
    assert t["tf32"].breakdown["matmuls"] < t["fp32"].breakdown["matmuls"]
    assert t["tf32"].breakdown["elementwise"] == t["fp32"].breakdown["elementwise"]
    assert t["amp-bf16+compile"].kernels < t["bf16"].kernels  # fused
    assert all(math.isclose(sum(x.breakdown.values()), x.step_s) for x in t.values())
    fastest = min(t, key=lambda n: t[n].step_s)
    err = report.speed_error  # a rival within each other's band is a tie, named by the safer numerics instead
    tied = [n for n in t if n != fastest and t[n].step_s * (1 - err) <= t[fastest].step_s * (1 + err)]
    named = report.fastest
    assert named == fastest if not tied else named in [fastest, *tied] and "a tie" in report.speed_answer
    assert report.speed_answer.startswith(f"Fastest predicted on NVIDIA H100 80GB: {named}, ")
    fastest = named
    again = load_record(str(path))
    assert again.result("tf32").time == t["tf32"] and again.fastest == fastest and "XLA" in again.rates
    shown = run_cli("show", str(path))
    flat = " ".join(shown.stdout.split())  # the terminal wraps the answer
    assert shown.returncode == 0 and "speedup vs fp32" in shown.stdout and report.speed_answer in flat
    assert f"{t[fastest].speedup:.2f}x" in flat


def test_the_baseline_can_be_named_and_a_wrong_one_is_one_line():
    report = dtypelab.forecast("gpt2", policies="fp32,bf16", device="H100", baseline="bf16", batch_search=False,
                               launcher="inline")
    assert report.baseline == "bf16" and report.result("bf16").time.speedup == 1.0
    assert report.result("fp32").time.speedup < 1
    with pytest.raises(DtypelabError, match=r"--baseline amp-fp16: not among the policies forecast \(fp32, bf16\)"):
        dtypelab.forecast("gpt2", policies="fp32,bf16", device="H100", baseline="amp-fp16", launcher="inline")


def test_without_a_device_there_is_no_time_and_the_forecast_says_why():
    report = dtypelab.forecast("gpt2", policies="fp32", batch_search=False, launcher="inline")
    assert report.result("fp32").time is None and report.fastest == ""
    assert report.speed_answer == "No device named (--device): no time is forecast."


def test_the_cpu_self_check_times_the_same_steps_here():
    report = dtypelab.forecast("digits", policies="fp32,bf16", device="cpu", check=True, batch_search=False,
                               launcher="inline")
    for p in report.policies:
        assert p.time.step_s > 0 and p.time.measured_s > 0
    fp32, bf16 = report.result("fp32").time, report.result("bf16").time
    assert fp32.measured_speedup == 1.0
    # the measured speedup is the two measured steps' ratio, beside the predicted one from the predicted steps
    assert bf16.measured_speedup == pytest.approx(fp32.measured_s / bf16.measured_s)
    assert bf16.speedup == pytest.approx(fp32.step_s / bf16.step_s)
    assert "measured here" in report.rates


def test_cpu_rates_come_from_the_probe_and_an_old_probe_is_refused_in_one_line():
    hw = fake_hardware()
    with pytest.raises(NoRate, match="run `dtypelab hardware` again"):
        cpu_rates(hw)

    rates = cpu_rates(replace(hw, bandwidth_gbs=20.0, op_floor_us=4.0,
                              small_gflops={"float32": {"16": 1.0, "32": 10.0, "64": 40.0, "128": 80.0}}))
    assert rates.flops["float32"] == 100e9 and rates.bandwidth == 20e9 and rates.floor_s == 4e-6
    assert rates.efficiency(64**3, "float32") == pytest.approx(0.4)
    assert rates.efficiency(512**3, "float32") == 1.0 and rates.efficiency(64**3, "bfloat16") == 1.0


def test_which_float8_layers_pay_is_their_matmuls_saving_net_of_their_own_casts():
    from dtypelab.core.machine.speed import float8_layers

    big = Op("matmuls", "fp8", 2e12, ((1, 10**9), (2, 10**9)), ((3, 10**6),), 1e12, module="mlp")
    small = Op("matmuls", "fp8", 2e6, ((4, 10**3), (5, 10**3)), ((6, 10**3),), 1e6, module="proj")
    casts = [Op("casts", "", 0, ((7, 10**6),), ((1, 10**6),), module="mlp"),
             Op("casts", "", 0, ((8, 10**8),), ((4, 10**8),), module="proj")]
    pays, loses = float8_layers([big, small, *casts], FLAT)
    # mlp: its GEMM at bf16's rate (4e12) against fp8's (8e12) saves 0.25 s; its cast moves 2 MB (20 µs)
    assert [m for m, _ in pays] == ["mlp"] and pays[0][1] == pytest.approx(2e12 / 4e12 - 2e12 / 8e12 - 2e6 / 1e11)
    # proj: a tiny GEMM at the floor either way saves nothing, and its cast moves 200 MB
    assert [m for m, _ in loses] == ["proj"] and loses[0][1] == pytest.approx(-2e8 / 1e11)


def test_a_storage_keeps_its_serial_while_it_lives_and_a_later_one_never_takes_it():
    import gc

    from dtypelab.forecasting.ledger import Ledger

    ledger = Ledger()
    first = torch.empty(4).untyped_storage()
    n = ledger.serial(first)
    assert ledger.serial(torch.empty(0).set_(first).untyped_storage()) == n  # a view of it: the same
    gone = id(first)
    del first
    gc.collect()
    assert gone not in ledger._serials  # an id freed may come back for another storage: its serial does not
    assert ledger.serial(torch.empty(4).untyped_storage()) > n


def test_a_rowwise_scaled_float8_gemm_of_the_forward_runs_at_the_published_share_of_a_tensorwise_one():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    from dtypelab.core.machine.speed import ROWWISE_EFFICIENCY
    from dtypelab.forecasting.ops import _variant

    x = torch.randn(8, 16)
    rowwise = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                          gemm_input_role=GemmInputRole.INPUT,
                                          scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    tensorwise = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                             gemm_input_role=GemmInputRole.INPUT)
    assert _variant("fp8", [rowwise], "forward") == "rowwise"
    # a tensorwise scale, the backward's slow-accumulating GEMMs (cuBLAS, scales after) and other rates: plain
    assert _variant("fp8", [tensorwise], "forward") == _variant("fp8", [rowwise], "backward") == ""
    assert _variant("bfloat16", [x], "forward") == ""
    h100 = gpu_rates(device_spec("H100"))
    big = Op("matmuls", "fp8", 2 * 8192**3, work=8192**3)
    slower = op_time(replace(big, variant="rowwise"), h100)[0]
    assert slower == pytest.approx(op_time(big, h100)[0] / ROWWISE_EFFICIENCY)
    assert op_time(replace(big, variant="rowwise"), FLAT)[0] == op_time(big, FLAT)[0]  # no variant known: plain


def test_a_cpu_forecast_beside_a_busy_process_times_in_rounds_and_says_it_could_not_time(monkeypatch):
    """Every kernel (and --check's steps) timed again in interleaved rounds, each keeping its fastest; when every round
    was disturbed the record says so for each policy and the answer names no fastest policy."""
    from dtypelab.core import disturbance

    class Busy:
        def start(self):
            pass

        def stop(self):
            return disturbance.Disturbance(wall_s=1.0, other_cpu_s=0.9, steal_s=0.0, pressure_s=0.8,
                                           involuntary_switches=50, raw_other_cpu_s=0.9)

    monkeypatch.setattr(disturbance, "CpuMeter", Busy)  # every round, the kernels' and the steps'
    report = dtypelab.forecast("digits", policies="fp32,fp64", device="cpu", check=True, batch_search=False,
                               launcher="inline")
    for p in report.policies:
        assert p.time.step_s > 0 and p.time.measured_s > 0
        assert p.time.disturbed.startswith("the machine was busy in every round of timing its kernels (other "
                                           "processes used 0.90 of a core")
    assert report.fastest == "" and report.speed_answer.startswith("No fastest policy is named: the machine was busy")
    # a quiet round: nothing said, and a fastest policy named
    class Quiet(Busy):
        def stop(self):
            return None

    monkeypatch.setattr(disturbance, "CpuMeter", Quiet)
    quiet = dtypelab.forecast("digits", policies="fp32,fp64", device="cpu", batch_search=False, launcher="inline")
    assert all(p.time.disturbed == "" for p in quiet.policies) and quiet.fastest in ("fp32", "fp64")


def test_retiming_keeps_each_kernels_fastest_call_and_stops_after_a_quiet_round(monkeypatch):
    from dtypelab.forecasting import kernels

    x = torch.randn(64, 64)
    key = kernels.signature(torch.ops.aten.mm.default, (x, x), {})
    done = {key: 10.0}  # as if the first timing fell in a long burst
    rounds, busy = kernels.retime(done, budget_s=5.0)
    assert done[key] < 0.1 and rounds >= 1
    assert busy is None or rounds == kernels.ROUNDS  # stopped at the first quiet round, or every one was busy


def test_predicted_speedups_carry_the_validated_band_and_overlapping_ones_are_a_tie_broken_by_safer_numerics(
        monkeypatch):
    from dtypelab.core.policies import get_policy
    from dtypelab.forecasting import timing
    from dtypelab.forecasting.timing import safer

    # the tie rule at a band of 20% (the evidence's band is core.bands', test_validation holds the forecast to it)
    monkeypatch.setattr(timing, "band", lambda family, default=0.0: 0.20 if family == "train-speed" else default)

    # float32 weights before a wider compute format, before speed (as bench breaks ties)
    assert safer(get_policy("amp-bf16")) > safer(get_policy("bf16")) and safer(get_policy("tf32")) > \
        safer(get_policy("fp8-tensorwise"))
    report = dtypelab.forecast("gpt2", policies="fp32,bf16,fp8-tensorwise", device="H100", batch_search=False,
                               launcher="inline")
    t = {p.policy: p.time for p in report.policies}
    e = 0.20
    assert report.speed_error == e
    fastest = min(t, key=lambda n: t[n].step_s)
    close = [n for n in t if n != fastest and t[n].step_s * (1 - e) <= t[fastest].step_s * (1 + e)]
    # the reduced gpt2's step is overhead-bound on an H100: bf16 and fp8-tensorwise within the band of each other
    assert fastest == "fp8-tensorwise" and close == ["bf16"]
    assert report.fastest == "fp8-tensorwise"  # the safer: float32 weights
    assert "Within that error of it: bf16" in report.speed_answer
    assert "a tie, broken by the safer numerics (fp8-tensorwise keeps float32 weights)" in report.speed_answer
    assert f"±{e:.0%}" in report.speed_answer
    from dtypelab.render.forecast import time_docs

    (_, headers, rows, notes), = time_docs(report)
    assert any(n.startswith(f"speedup: predicted, ± {e:.0%}") for n in notes)
    row = next(r for r in rows if r[0] == "bf16")
    s = t["bf16"].speedup
    assert row[headers.index("speedup vs fp32")] == f"{s:.2f}x ({s * (1 - e):.2f}–{s * (1 + e):.2f})"
