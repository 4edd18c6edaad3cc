"""The vLLM engine's forecast (--engine vllm): its memory accounting against vLLM's arithmetic and its published
start-up failures, its defaults, a decode step's ops at any batch from two traces against a trace at that batch, tensor
parallel's split and all-reduce, where a format stops paying against brute force, and the command's one-line
errors."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
from test_cli import dtypelab

from dtypelab.core.machine.speed import Op
from dtypelab.forecasting import target_device
from dtypelab.serving.engine import (
    ALL_REDUCE_S,
    NON_TORCH_GIB,
    SAMPLER_BYTES,
    Engine,
    all_reduce_s,
    engine_memory,
    ops_at,
    resolve,
    split,
    stops_paying,
)

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "benchmarks", "configs")
GIB = 2**30


def _config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.join(CONFIGS, name))


def _vllm(**kw) -> Engine:
    return Engine("vllm", **{"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "max_model_len": 16000, **kw})


@pytest.mark.parametrize("tp,kv_bytes,block", [(1, 2, 16), (2, 2, 16), (1, 1, 32), (4, 1, 128)])
def test_the_kv_pool_is_the_budget_less_the_rest_in_whole_pages_as_vllm_counts_it(tp, kv_bytes, block):
    """vLLM's arithmetic, written out again here: requested = utilization x total; the pool is what the weights (a
    card's share), the profile run's peak and the memory outside torch leave; num_blocks = pool // page_size //
    layers; tokens = blocks x block size; concurrency = blocks / cdiv(max_model_len, block size)."""
    cfg = _config("llama3.1-8b")
    eng = _vllm(tensor_parallel_size=tp, block_size=block)
    total, weights = int(79.18 * GIB), 16_060_000_000
    mem = engine_memory(cfg, weights, kv_bytes, eng, total)
    requested = int(total * 0.9)
    sampler = SAMPLER_BYTES * 1024 * cfg.vocab_size
    pool = requested - math.ceil(weights / tp) - int(sampler) - int(NON_TORCH_GIB.get(tp, NON_TORCH_GIB[2]) * GIB)
    per_layer_page = block * 2 * (8 // tp if tp <= 8 else 1) * 128 * kv_bytes
    blocks = pool // per_layer_page // 32
    assert (mem.kv_pool, mem.blocks, mem.tokens) == (pool, blocks, blocks * block)
    assert mem.concurrency == pytest.approx(blocks / math.ceil(16000 / block))
    assert not mem.why
    odd = engine_memory(cfg, weights, kv_bytes, _vllm(tensor_parallel_size=tp, block_size=block, max_model_len=16001),
                        total)
    assert odd.concurrency == pytest.approx(blocks / (16000 // block + 1))  # a request's last page is whole


def test_the_published_start_up_failures_are_forecast_to_fail():
    """llm-d's H100 logs: Qwen3-32B at --max-model-len 32000 failed (its pool holds fewer tokens than one request)
    while 16000 started; Llama-3.3-70B in fp8 on one card had no memory left for the cache (-1.44 GiB)."""
    total = int(79.18 * GIB)
    qwen = _config("qwen3-32b")
    weights = int(61.03 * GIB)
    assert engine_memory(qwen, weights, 2, _vllm(max_model_len=16000), total).why == ""
    failed = engine_memory(qwen, weights, 2, _vllm(max_model_len=32000), total)
    assert "max seq len (32,000) is larger than the KV cache holds" in failed.why
    llama = engine_memory(_config("llama3.1-70b"), int(67.72 * GIB), 1, _vllm(), total)
    assert llama.kv_pool < 0 and llama.blocks == 0 and "no available memory for the cache blocks" in llama.why


@pytest.mark.parametrize("device,tokens,seqs", [("H100", 8192, 1024), ("H200", 8192, 1024), ("A100-80GB", 2048, 256),
                                                ("L4", 2048, 256), ("RTX4090", 2048, 256)])
def test_vllms_batch_defaults_follow_the_card(device, tokens, seqs):
    """vllm/engine/arg_utils.py get_batch_defaults (vllm serve): 70 GiB or more and not an A100 gets the larger."""
    eng = resolve(Engine("vllm"), target_device(device, None, None), 131072)
    assert (eng.max_num_batched_tokens, eng.max_num_seqs, eng.max_model_len) == (tokens, seqs, 131072)
    capped = resolve(Engine("vllm", max_num_batched_tokens=512), target_device(device, None, None), 4096)
    assert capped.max_num_seqs == min(seqs, 512)  # never more sequences than a step's tokens


def test_a_decode_steps_ops_at_any_batch_are_the_line_through_two_traces():
    """The ops at batch 5 read off the traces at batches 1 and 2 are the trace at batch 5, op by op."""
    from dtypelab.serving.fake_serve import PolicyRun, ServeForecaster
    from dtypelab.serving.policies import serve_policy
    from dtypelab.serving.served import load_served
    from dtypelab.serving.workload import Shape

    fc = ServeForecaster(load_served(f"hf:{CONFIGS}/tiny-llama"), target_device("H100", None, None), 0)
    run = PolicyRun(fc, serve_policy("bf16"), {})
    one, two, five = (run.traced(Shape(40, 1, b), timed=True).decode.ops for b in (1, 2, 5))
    read = ops_at(one, two, 5)
    assert len(read) == len(five)
    for a, b in zip(read, five, strict=True):
        assert (a.group, a.rate) == (b.group, b.rate)
        assert a.flops == pytest.approx(b.flops, rel=1e-9, abs=1e-6)
        assert a.read == pytest.approx(b.read, abs=len(a.reads)) and a.written == pytest.approx(b.written,
                                                                                               abs=len(a.writes))


def test_tensor_parallel_splits_each_op_and_adds_two_all_reduces_a_layer():
    op = Op("matmuls", "bfloat16", 8e9, ((1, 4000), (2, 1000)), ((3, 800),), work=4e9)
    assert split((op,), 1) == (op,)
    half = split((op,), 2)[0]
    assert (half.flops, half.work, half.read, half.written) == (4e9, 2e9, 2500, 400)
    assert all_reduce_s(100, 8192, 80, 1, 450) == 0.0
    moved = 2 * 7 / 8 * 100 * 8192 * 2
    assert all_reduce_s(100, 8192, 80, 8, 450) == pytest.approx(2 * 80 * (ALL_REDUCE_S + moved / 450e9))
    with pytest.raises(ValueError):
        all_reduce_s(100, 8192, 80, 2, None)


def _brute_stops(curve, base, higher, error=0.0):
    """The least concurrency c read such that at c and every one after it the format is no better, or within
    ``error`` of the baseline (their bands [x(1-e), x(1+e)] overlap)."""
    theirs = dict(base)
    points = [c for c, _ in curve if c in theirs]

    def tie(a, b):
        return not (a * (1 + error) < b * (1 - error) or b * (1 + error) < a * (1 - error))

    better = {c: ((v > theirs[c]) if higher else (v < theirs[c])) and not tie(v, theirs[c])
              for c, v in curve if c in theirs}
    for c in points:
        if all(not better[d] for d in points if d >= c):
            return c
    return None


def test_where_a_format_stops_paying_is_what_brute_force_finds():
    rng = random.Random(7)
    steps = (1, 2, 4, 8, 16, 32, 64, 128)
    for _ in range(500):
        base = tuple((c, rng.uniform(1, 2)) for c in steps)
        curve = tuple((c, rng.uniform(1, 2)) for c in steps)
        higher = rng.random() < 0.5
        error = rng.choice((0.0, 0.03, 0.2))
        assert stops_paying(curve, base, higher, error) == _brute_stops(curve, base, higher, error)
    assert stops_paying(((1, 2.0), (2, 1.0)), ((1, 1.0), (2, 1.5))) == 2
    assert stops_paying(((1, 0.5), (2, 0.5)), ((1, 1.0), (2, 1.0))) == 1  # never pays
    assert stops_paying(((1, 2.0), (2, 2.0)), ((1, 1.0), (2, 1.0))) is None  # pays throughout
    assert stops_paying(((1, 2.0), (2, 1.05)), ((1, 1.0), (2, 1.0)), error=0.03) == 2  # 5% ahead: a tie at ±3%


def test_the_engine_forecast_records_kv_capacity_concurrency_settings_and_where_formats_stop_paying(tmp_path):
    out = tmp_path / "v.json"
    run = dtypelab("forecast", f"hf:{CONFIGS}/tiny-llama", "--mode", "generate", "--engine", "vllm", "--device",
                   "H100", "-p", "bf16,int4-wo,fp8-dyn-row", "-b", "16", "--prompt-len", "64", "--gen-len", "32",
                   "--max-model-len", "256", "--json", str(out))
    assert run.returncode == 0, run.stderr + run.stdout
    d = json.loads(out.read_text())
    assert d["schema_version"] == 5
    assert d["config"]["engine"] == "vllm"
    assert d["config"]["engine_settings"] == {
        "gpu-memory-utilization": 0.9, "max-num-batched-tokens": 8192, "max-num-seqs": 1024, "block-size": 16,
        "kv-cache-dtype": "auto", "max-model-len": 256, "tensor-parallel-size": 1}
    by = {p["policy"]: p["generate"] for p in d["policies"]}
    for name, g in by.items():
        mem = g["engine_memory"]
        assert g["kv_capacity_tokens"] == mem["blocks"] * 16 and g["max_concurrency"] == pytest.approx(
            mem["blocks"] / 16)  # 256 tokens a request: 16 pages
        assert g["decode_tok_s"] and g["token_latency_s"] and g["ttft_s"]
        assert [p["concurrency"] for p in g["curve"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        if name != "bf16":
            assert set(g["stops_paying"]) == {"tok/s", "J/token"}
    smaller = by["int4-wo"]["weights_bytes"] < by["bf16"]["weights_bytes"]  # then a bigger pool
    assert smaller == (by["int4-wo"]["kv_capacity_tokens"] > by["bf16"]["kv_capacity_tokens"])
    assert "KV tokens" in run.stdout and "stops paying at" in run.stdout and "vLLM v0.11" in run.stdout
    shown = subprocess.run([sys.executable, "-m", "dtypelab", "show", str(out)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "COLUMNS": "80"})
    head = "".join(shown.stdout.splitlines()[2:9])
    assert "KV" in head and "stops" in head and max(len(line) for line in shown.stdout.splitlines()) <= 80


def test_an_fp8_kv_cache_doubles_the_tokens_a_pool_holds(tmp_path):
    out = {}
    for dtype in ("auto", "fp8"):
        path = tmp_path / f"{dtype}.json"
        run = dtypelab("forecast", f"hf:{CONFIGS}/tiny-llama", "--mode", "generate", "--engine", "vllm",
                       "--device", "L4", "-p", "bf16", "--kv-cache-dtype", dtype, "--no-speed", "--json", str(path))
        assert run.returncode == 0, run.stderr + run.stdout
        out[dtype] = json.loads(path.read_text())["policies"][0]["generate"]
    assert out["fp8"]["engine_memory"]["kv_pool"] == out["auto"]["engine_memory"]["kv_pool"]
    assert out["fp8"]["engine_memory"]["page"] * 2 == out["auto"]["engine_memory"]["page"]
    assert out["fp8"]["kv_capacity_tokens"] >= 2 * out["auto"]["kv_capacity_tokens"] - 16


@pytest.mark.parametrize("args,words", [
    (["--gpu-memory-utilization", "0.8"], "--gpu-memory-utilization is vLLM's: add --engine vllm"),
    (["--engine", "vllm", "--device", "cpu"], "--engine vllm forecasts a GPU"),
    (["--engine", "vllm", "--memory", "24GiB", "--tensor-parallel-size", "2"], "no interconnect bandwidth"),
    (["--engine", "vllm", "--device", "H100", "--tensor-parallel-size", "9"], "tensor-parallel-size"),
    (["--engine", "vllm", "--device", "H100", "--max-model-len", "100000"], "longer than the model's context"),
    (["--engine", "vllm", "--device", "H100", "--no-batch-search"], "do not apply to --engine vllm"),
    (["--engine", "vllm", "--device", "H100", "--reserve", "1GiB"], "do not apply to --engine vllm"),
])
def test_bad_engine_inputs_are_one_line_errors(args, words):
    run = dtypelab("forecast", f"hf:{CONFIGS}/tiny-llama", "--mode", "generate", "-p", "bf16", *args)
    assert run.returncode != 0 and words in run.stdout + run.stderr, run.stdout + run.stderr
    assert "Traceback" not in run.stderr


def test_the_engine_is_refused_for_a_training_step():
    run = dtypelab("forecast", f"hf:{CONFIGS}/tiny-llama", "--engine", "vllm")
    assert run.returncode != 0 and "--engine does not apply to --mode step" in run.stdout + run.stderr


@pytest.mark.parametrize("policies,args,words", [
    ("bf16+kv-int8", [], "vLLM has no kv-int8 KV cache"),
    ("bf16+kv-int8", ["--kv-cache-dtype", "fp8"], "names its own KV format (kv-int8)"),
    ("fp8-dyn-row", ["--device", "A100-80GB"], "compute capability 8.0; it needs 8.9"),
])
def test_what_the_engine_cannot_serve_is_said_for_that_policy(tmp_path, policies, args, words):
    path = tmp_path / "r.json"
    run = dtypelab("forecast", f"hf:{CONFIGS}/tiny-llama", "--mode", "generate", "--engine", "vllm",
                   *(args if "--device" in args else ["--device", "H100", *args]), "-p", f"bf16,{policies}",
                   "--no-speed", "--json", str(path))
    reasons = {p["policy"]: p.get("reason", "") for p in json.loads(path.read_text())["policies"]}
    assert words in reasons[policies], (reasons, run.stdout)


def test_a_version_3_generate_record_reads_as_the_static_engine(tmp_path):
    from dtypelab.core.records import load_record
    from dtypelab.core.results import GenerateReport

    d = {"schema": "dtypelab.generate", "schema_version": 3, "config": {
        "task": "t", "task_name": "t", "source": "forecast", "prompt_len": 8, "gen_len": 4, "batch_size": 1},
         "policies": []}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    r = load_record(str(path))
    assert isinstance(r, GenerateReport)
    assert r.config.engine == "static" and r.config.engine_settings == {}


def test_bench_says_it_measures_the_static_engine(tmp_path):
    out = tmp_path / "b.json"
    run = dtypelab("bench", f"hf:{CONFIGS}/tiny-llama", "--mode", "generate", "-p", "fp32", "--prompt-len", "8",
                   "--gen-len", "4", "-b", "1", "--rounds", "3", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert any("vLLM does not run on this CPU" in n for n in json.loads(out.read_text())["notes"])


def test_vllm_runs_machete_for_int4_on_hopper_and_marlin_before_it():
    from dtypelab.serving.kernels import VLLM_HOPPER, VLLM_KERNELS, kernel_of

    assert kernel_of("int4-weight-only", "vllm", (9, 0)) is VLLM_HOPPER["int4-weight-only"]
    assert kernel_of("int4-weight-only", "vllm", (8, 9)) is VLLM_KERNELS["int4-weight-only"]
    assert kernel_of("int4-weight-only", "static", (9, 0)).name.startswith("tinygemm")
    assert "Machete" in VLLM_HOPPER["int4-weight-only"].name and "Marlin" in VLLM_KERNELS["int4-weight-only"].name
