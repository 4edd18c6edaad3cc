"""Distributed policies (bench --nproc): 2-process gloo runs on the CPU under torchrun, the modifiers' syntax, the
bytes each sends, equality with single-process training, failures of one rank, and the scaling estimate."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
from conftest import TINY, avx2_hardware, fake_hardware, made_once, started_with

import dtypelab
from dtypelab.core.policies import Distributed, Plan, get_policy
from dtypelab.core.results import DistStats, PolicyResult, Report, RunConfig
from dtypelab.core.text import size_text
from dtypelab.distributed.scaling import estimate, parse_links, predict
from dtypelab.render.bench import render_markdown

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, fast_bf16_env):
    """The default distributed set on the tiny task, once a session, through the CLI: its record for the tests below
    (with a probe that runs bf16 whatever this CPU is: the slow-bf16 refusal is tested below)."""
    def make(path: str) -> None:
        env = {**fast_bf16_env, "COLUMNS": "250"}
        run = subprocess.run([sys.executable, "-m", "dtypelab", "bench", f"{TINY}:make_task", "--nproc", "2",
                              "--steps", str(STEPS), "--warmup", "2", "--budget", "0", "--json", path, "--format",
                              "markdown"], capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stderr
        assert "scaling estimate (not measured)" in run.stdout and "fp32+fsdp-bf16-params-fp32-reduce" in run.stdout

    return dtypelab.load_record(made_once(tmp_path_factory, "dist-sweep.json", make))


def test_modifiers_parse_compose_and_round_trip(tmp_path):
    assert Distributed.parse("ddp-powersgd-r4") == Distributed(hook="powersgd", rank=4)
    assert Distributed.parse("fsdp-bf16") == Distributed("fsdp", param_dtype="bfloat16", reduce_dtype="float32")
    assert Distributed.parse("fsdp-bf16-params-fp32-reduce").label == "fsdp-bf16-params-fp32-reduce"
    plan = get_policy("amp-bf16+ddp-bf16")
    assert plan.name == "amp-bf16+ddp-bf16" and plan.distributed.hook == "bf16" and plan.modes == ("train",)
    path = tmp_path / "p.json"
    path.write_text(Plan.from_dict({**get_policy("fp32+fsdp-bf16").to_dict(), "name": ""}).to_json())
    loaded = dtypelab.load_plan(str(path))
    assert loaded.distributed == Distributed("fsdp", param_dtype="bfloat16", reduce_dtype="float32")
    assert get_policy(f"{path}+ddp-fp16").distributed.hook == "fp16"
    for bad, message in (("fp32+ddp-int4", "unknown distributed modifier"), ("int8-dyn+ddp", "inference-only")):
        with pytest.raises(dtypelab.DtypelabError, match=message):
            get_policy(bad)


def test_distributed_options_are_refused_where_they_mean_nothing():
    cases = ((dict(policies="fp32+ddp-fp16"), "give --nproc"), (dict(nproc=2, mode="infer"), "--mode infer"),
             (dict(nproc=2, per_layer=True, mode="train"), "--per-layer"), (dict(nnodes=2), "need --nproc"),
             (dict(nproc=2, nnodes=2), "--rdzv-endpoint"), (dict(link_gbps="25gbe"), "give --nproc"),
             (dict(nproc=2, link_gbps="fast"), "preset"))
    for kwargs, message in cases:
        with pytest.raises(dtypelab.DtypelabError, match=message):
            dtypelab.bench(f"{TINY}:make_task", kwargs.pop("policies", None), **kwargs)


@pytest.mark.e2e
def test_ddp_fp32_equals_single_process_training(sweep):
    single = dtypelab.bench(f"{TINY}:make_task", "fp32", steps=STEPS, warmup=2, isolate=False, rounds=0)
    one, two = single.result("fp32"), sweep.result("fp32")
    assert two.status == "ok" and two.distributed.nproc == 2 and two.init_fingerprint == one.init_fingerprint
    assert two.losses == pytest.approx(one.losses, rel=1e-4)  # same global batch, averaged gradients
    assert two.metric("accuracy") == pytest.approx(one.metric("accuracy"), abs=1 / 256)


@pytest.mark.e2e
def test_compression_halves_the_bytes_exactly_and_every_default_policy_runs(sweep):
    assert [r.status for r in sweep.results] == ["ok"] * 6, [(r.policy, r.reason) for r in sweep.results]
    by = {r.policy: r.distributed for r in sweep.results}
    fp32 = by["fp32"].payload_bytes["all_reduce"]
    params = sum(p.numel() for p in dtypelab.load_task(f"{TINY}:make_task").make_model().parameters())
    assert fp32 == 4 * params  # every gradient, once, in float32
    assert by["fp32+ddp-fp16"].payload_bytes == {"all_reduce": fp32 // 2}
    assert by["fp32+ddp-bf16"].payload_bytes == {"all_reduce": fp32 // 2}  # gloo: dtypelab's own bf16 hook
    assert by["fp32+ddp-powersgd"].payload_bytes["all_reduce"] < fp32
    fsdp, mixed = by["fp32+fsdp"].payload_bytes, by["fp32+fsdp-bf16-params-fp32-reduce"].payload_bytes
    assert set(fsdp) == {"all_gather", "reduce_scatter"} and mixed["all_gather"] * 2 == fsdp["all_gather"]
    assert mixed["reduce_scatter"] == fsdp["reduce_scatter"]  # reduced in float32 as asked
    d = by["fp32"]
    assert d.wire_bytes == fp32 and len(d.rank_peak_bytes) == 2 and d.compute_s > 0 and d.link_gbps > 0
    assert sweep.scaling is not None and set(sweep.scaling.validation) == set(by)
    text = render_markdown(sweep)
    # the tables carry the record's numbers: each policy's wire bytes and its ratio to fp32's, each estimate
    for policy, d in by.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {policy} | {d.modifier} |"))
        assert f"| {size_text(d.wire_bytes)} | {d.wire_bytes / fp32:.3g}x |" in row, row
    eight = [p for p in sweep.scaling.points if p.nproc == 8]
    assert eight  # the table shows 8 ranks: the estimate must have them
    for p in eight:
        assert f"| {p.speedup:.2f}x |" in text


@pytest.mark.e2e
def test_the_html_report_shows_the_distributed_tables(sweep, tmp_path):
    record, page = tmp_path / "r.json", tmp_path / "r.html"
    sweep.save(str(record))
    dtypelab.report([str(record)], str(page))
    html = page.read_text()
    wire = {r.policy: size_text(r.distributed.wire_bytes) for r in sweep.results}
    assert all(f">{w}</td>" in html for w in wire.values()), wire  # the record's bytes, in the page's table
    shown = [p for p in sweep.scaling.points if p.nproc in (8, 64)]
    assert shown and all(f">{p.speedup:.2f}x</td>" in html for p in shown)


@pytest.mark.e2e
def test_a_failing_rank_is_reported_a_hanging_one_times_out_and_no_process_is_left(monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("LEAK_PROBE", token)  # torchrun's ranks and anything they start: this test's, not a neighbour's
    report = dtypelab.bench(f"{TINY}:make_rank_trap_task", "fp32,bf16,fp64", nproc=2, steps=4, warmup=1, budget=0,
                            timeout_s=15, hardware=fake_hardware())
    assert report.result("fp32").status == "ok"
    bad = report.result("bf16")
    assert bad.status == "failed" and bad.reason.startswith("rank 1: ValueError: planted failure on rank 1")
    assert report.result("fp64").status == "timeout"
    assert not started_with(token)


@pytest.mark.e2e
def test_where_bf16_is_slow_the_bf16_modifiers_are_skipped_as_slow_without_running():
    report = dtypelab.bench(f"{TINY}:make_task", "fp32+fsdp-bf16-params-fp32-reduce", nproc=2, steps=4, warmup=1,
                            budget=0, hardware=avx2_hardware())
    skipped = report.result("fp32+fsdp-bf16-params-fp32-reduce")
    assert skipped.status == "skipped" and skipped.skip == "slow" and "no native bfloat16" in skipped.reason
    assert report.result("fp32").status == "ok"


def test_the_scaling_estimate_can_say_not_worth_it():
    cfg = RunConfig("t", "train", ("fp32", "fp32+ddp-fp16"), 10, 8, 1, 0, "1%", "cpu", False, 60, "acc", True,
                    nproc=2)

    def result(name: str, compute: float, payload: int, step: float, alpha: float = 1e-4) -> PolicyResult:
        d = DistStats(2, 1, "gloo", "ddp", name, {"all_reduce": payload}, payload, 1, 0.0, compute, (1, 1),
                      (step, step), alpha, 10.0, 8 << 20)
        return PolicyResult(name, "ok", step_times_s=(step,) * 5, distributed=d, metrics={"acc": 1.0})

    # fp16 saves 2 MB per step but its casts cost 50 ms: never worth it on these links
    report = Report(cfg, {}, (result("fp32", 0.010, 4 << 20, 0.02), result("fp32+ddp-fp16", 0.060, 2 << 20, 0.07)))
    est = estimate(report, parse_links("25gbe,nvlink4"), {})
    assert est.verdicts["fp32+ddp-fp16"].startswith("not worth it")
    assert predict(report.results[0], 2, 10.0) == pytest.approx(0.010 + 1e-4 + (4 << 20) * 8 / 10e9)
    # a hook measured cheaper than plain DDP (noise) gets no credit for it: same bytes, no gain
    noise = replace(report, results=(report.results[0], result("fp32+ddp-fp16", 0.005, 4 << 20, 0.02)))
    assert estimate(noise, parse_links("25gbe"), {}).verdicts["fp32+ddp-fp16"].startswith("not worth it")
    # the same compression with free casts pays where bytes dominate
    cheap = replace(report, results=(report.results[0], result("fp32+ddp-fp16", 0.010, 2 << 20, 0.02)))
    assert "pay from" in estimate(cheap, parse_links("25gbe"), {}).verdicts["fp32+ddp-fp16"]
    # nor for a quieter link probe in its own run: α belongs to the link, so every policy gets the same one
    quiet = replace(report, results=(result("fp32", 0.010, 4 << 20, 0.02, alpha=2e-3),
                                     result("fp32+ddp-fp16", 0.010, 4 << 20, 0.02, alpha=1e-6)))
    assert estimate(quiet, parse_links("25gbe"), {}).verdicts["fp32+ddp-fp16"].startswith("not worth it")


@pytest.mark.cuda
def test_nccl_stock_bf16_hook_on_one_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    report = dtypelab.bench(f"{TINY}:make_task", "fp32,fp32+ddp-bf16,fp32+fsdp-bf16", nproc=1, steps=6, warmup=2,
                            device="cuda", budget=0)
    assert [r.status for r in report.results] == ["ok"] * 3, [r.reason for r in report.results]
    assert report.result("fp32+ddp-bf16").distributed.backend == "nccl"


def test_the_root_cause_is_the_rank_torchrun_names_not_its_consequences(tmp_path):
    from dtypelab.run.torchrun import root_cause

    consequence = ("failed", "rank 1: RuntimeError: Connection reset by peer (at train.py:110)", 1)
    log = tmp_path / "torchrun.log"
    log.write_text("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                   "  what():  [enforce fail at pair.cc:456] Received data size doesn't match expected size.\n"
                   "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-23_08:22:29\n"
                   "  rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 23397)  (SIGABRT)\n")
    _, reason = root_cause([consequence], str(log))
    assert reason.startswith("rank 0 killed by SIGABRT: [enforce fail")
    mine = ("failed", "rank 0: ValueError: mine (at model.py:3)", 0)
    assert root_cause([consequence, mine], str(log)) == mine[:2]


def test_one_rank_has_no_link_to_divide_by():
    """bench --nproc 1: nothing crosses a link and its bandwidth measures 0; the estimate still models N ranks."""
    cfg = RunConfig("t", "train", ("fp32", "fp32+ddp-fp16"), 10, 8, 1, 0, "1%", "cpu", False, 60, "acc", True,
                    nproc=1)
    runs = tuple(PolicyResult(name, "ok", step_times_s=(0.02,) * 5, metrics={"acc": 1.0}, distributed=DistStats(
        1, 1, "gloo", "ddp", name, {"all_reduce": payload}, 0, 1, 0.0, 0.019, (1,), (0.02,), 1e-5, 0.0, 8 << 20))
        for name, payload in (("fp32", 4 << 20), ("fp32+ddp-fp16", 2 << 20)))
    est = estimate(Report(cfg, {}, runs), parse_links("25gbe"), {})
    assert est.validation["fp32"] == pytest.approx((0.019 + 1e-5) / 0.02 - 1)
    assert predict(runs[0], 8, 25.0) > predict(runs[1], 8, 25.0)  # the halved payload pays at 8 ranks


def test_a_rank_that_only_lost_its_peer_is_not_the_root_cause_even_when_torchrun_names_it(tmp_path):
    """Rank 1 raised; rank 0's collective then lost it and exited first, so torchrun's summary names rank 0: the cause
    is rank 1's own error (seen on CI: 'Connection closed by peer' reported instead of the planted failure)."""
    from dtypelab.run.torchrun import root_cause

    log = tmp_path / "torchrun.log"
    log.write_text("Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1\n")
    lost = ("failed", "rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5353", 0)
    cause = ("failed", "rank 1: ValueError: planted failure on rank 1 (at tiny_task.py:9)", 1)
    assert root_cause([lost, cause], str(log)) == cause[:2]
    assert root_cause([lost], str(log)) == lost[:2]  # nothing better to say: what rank 0 saw
