"""Serving (--mode generate): the KV cache's formats and their bytes (grouped-query attention), the workload through
the cache against a forward without one, the forecast's trace against the same workload counted on real tensors, a
deep model read off shallow traces against its whole trace, the largest-size search against brute force, the GPU
kernel model, the measured sweep's decision, and one-line errors."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import replace

import pytest
import torch
from test_cli import dtypelab

from dtypelab.core.errors import DtypelabError
from dtypelab.core.results import GenerateFigures, GeneratePolicy, GenerateQuality
from dtypelab.forecasting import target_device
from dtypelab.serving import FORMATS, Shape, bytes_per_token, kv_format, serve_bench, serve_policy

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LLAMA = os.path.join(ROOT, "benchmarks", "configs", "tiny-llama")


def tiny_llama(layers: int = 2, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval(), config


# --- the cache ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", ["kv-native", *FORMATS])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_cache_stores_key_value_heads_only_and_its_bytes_are_the_formula(label, kv_heads):
    from dtypelab.serving.kv import cache_bytes
    from dtypelab.serving.workload import new_cache

    _, config = tiny_llama(kv_heads=kv_heads)
    fmt = kv_format(label)
    shape = Shape(10, 6, 3)
    cache = new_cache(config, fmt, shape, torch.float32, torch.device("cpu"))
    per_token = bytes_per_token(config, fmt, torch.float32)
    scale = fmt.scale_shape(2, kv_heads, 3)  # not per token (per head or per tensor): fixed, float32
    fixed = 2 * 2 * math.prod(scale) * 4 if scale is not None and scale[2] == 1 else 0  # per layer and key/value
    assert cache_bytes(cache) == per_token * shape.batch_size * shape.context + fixed
    assert cache.layers[0].keys.shape == (3, kv_heads, 16, 16)


@pytest.mark.parametrize("label,tol", [("kv-native", 1e-5), ("kv-bf16", 3e-2), ("kv-fp16", 3e-3), ("kv-int8", 3e-2),
                                       ("kv-fp8", 2e-1), ("kv-fp8-e5m2", 4e-1)])
def test_decoding_through_the_cache_gives_a_forward_without_one(label, tol):
    """Prefill then decode, token by token, through the cache: the last logits are a whole forward's, within the
    format's rounding."""
    from dtypelab.serving.workload import _call, new_cache

    model, config = tiny_llama()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids).logits[:, -1]
        cache = new_cache(config, kv_format(label), Shape(8, 4, 2), torch.float32, torch.device("cpu"))
        _call(model, ids[:, :8], cache, 1)
        for t in range(8, 12):
            last = _call(model, ids[:, t:t + 1], cache, 1)[:, -1]
    err = (last - whole).abs().max().item()
    assert err <= tol * whole.abs().max().item()
    if label != "kv-native":
        assert err > 0  # the format rounds: something changed


def test_a_scaled_cache_saturates_what_exceeds_the_prompts_range_rather_than_overflowing():
    from dtypelab.serving.kv import KVLayer

    layer = KVLayer(4, kv_format("kv-fp8"))
    small = torch.ones(1, 1, 1, 2)
    layer.update(small, small)
    keys, _ = layer.update(small * 1e6, small * 1e6)
    assert torch.isfinite(keys).all() and keys.max().item() == pytest.approx(1.0, rel=0.07)


# --- policies and errors --------------------------------------------------------------------------------------------
def test_a_serving_policy_is_a_weight_format_with_a_cache_format():
    p = serve_policy("int8-wo+kv-fp8")
    assert p.plan.name == "int8-wo" and p.kv.label == "kv-fp8"
    assert serve_policy("bf16").kv.label == "kv-native"
    for bad, words in [("int8-wo+kv-fp4", "unknown KV-cache format"), ("+kv-fp8", "modifies a weight format"),
                       ("bf16-kahan+kv-int8", "training policy")]:
        with pytest.raises(DtypelabError, match=words):
            serve_policy(bad)


@pytest.mark.parametrize("args,words", [
    (["bench", "tinylm", "--mode", "generate", "--prompt-len", "1000", "--gen-len", "100"], "takes at most 1024"),
    (["bench", "tinylm", "--mode", "generate", "-p", "fp32+kv-fp4"], "unknown KV-cache format"),
    (["bench", "digits", "--mode", "generate"], "not a causal language model"),
    (["forecast", "tinylm", "--mode", "generate", "--device", "H100", "--check"], "--check runs the workload here"),
    (["forecast", "tinylm", "--mode", "generate", "--device", "H100", "--prompt-len", "1024"], "takes at most 1024"),
])
def test_bad_serving_inputs_are_one_line_errors(args, words, tmp_path):
    got = dtypelab(*args, "--json", str(tmp_path / "r.json"))
    assert got.returncode == 2, got.stderr
    assert words in got.stderr and "Traceback" not in got.stderr
    assert len([line for line in got.stderr.splitlines() if line.startswith("error:")]) == 1


def test_a_cache_these_layers_cannot_hold_is_refused_in_one_line():
    from transformers import Gemma2Config

    from dtypelab.serving.kv import attention_layers

    config = Gemma2Config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(DtypelabError, match="linear_attention layers"):
        attention_layers(config)


def _sliding(kind: str, layers: int = 2, window: int = 8):
    from transformers import Gemma2Config, MistralConfig, Phi3Config

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, vocab_size=97, sliding_window=window, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "gemma2":  # alternating: even layers slide, odd ones attend to everything
        return Gemma2Config(head_dim=16, **common)
    return (MistralConfig if kind == "mistral" else Phi3Config)(**common)


@pytest.mark.parametrize("kind", ["mistral", "phi3", "gemma2"])
@pytest.mark.parametrize("label", ["kv-native", "kv-int8"])
@pytest.mark.parametrize("prompt,gen", [(5, 12), (12, 10), (8, 3)])
def test_a_sliding_window_cache_generates_what_transformers_generates(kind, label, prompt, gen):
    """A sliding layer holds its window only, in a ring: greedy generation through it (prompts shorter and longer
    than the window, generations that fill it and run past it) gives transformers' own logits and tokens; a chunk
    fed after the window is full (how quality is scored) gives the uncached forward's logits."""
    from transformers import AutoModelForCausalLM

    from dtypelab.serving.kv import held_tokens, make_cache

    config = _sliding(kind, layers=4 if kind == "gemma2" else 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 97, (2, prompt))
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        length = prompt + gen + 6  # room for the chunk after the generation
        cache = make_cache(config, kv_format(label), length)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        steps = [logits]
        for i in range(gen - 1):  # fed transformers' tokens: a rounded int8 cache may break a near tie
            token = ref.sequences[:, prompt + i:prompt + i + 1]
            steps.append(model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1])
    assert [layer.max_cache_len for layer in cache.layers] == held_tokens(config, length)
    assert all(layer.is_sliding for layer in cache.layers[::2])
    tokens = torch.stack([s.argmax(-1) for s in steps], dim=1)
    raw = torch.stack(ref.logits, dim=1).argmax(-1)  # the unprocessed logits' (min_new_tokens masks the end token)
    assert label != "kv-native" or torch.equal(tokens, raw)
    tol = 1e-5 if label == "kv-native" else 0.2  # int8 keys and values: rounded, as stored
    assert max((a - b).abs().max().item() for a, b in zip(steps, ref.logits, strict=True)) < tol
    if label == "kv-native" and prompt > 8:
        rest = torch.randint(0, 97, (2, 6))
        with torch.no_grad():
            chunk = model(input_ids=rest, past_key_values=cache, use_cache=True).logits
            whole = model(input_ids=torch.cat([ids, tokens[:, :-1], rest], dim=1)).logits[:, -6:]
        assert (chunk - whole).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_window_models_forecast_holds_each_window_and_reads_a_deep_model_right(kind, monkeypatch):
    """Nine blocks past their window (Mistral: every layer slides; Gemma-2: every other one): the cache the forecast
    counts is the formula's (each sliding layer its window), and the line through the traces at 3 and 4 blocks, the
    searches' shortcut included, gives the whole trace's peaks to the byte."""
    import dtypelab.forecasting.depth as fcmod
    from dtypelab.serving.fake_serve import PolicyRun, ServeForecaster
    from dtypelab.serving.kv import cache_bytes_at
    from dtypelab.serving.served import Served

    config = _sliding(kind, layers=9, window=16)
    monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 7)  # read off at 9 (a user's model: from 10 blocks)

    def make():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(config)

    served = Served("sliding9", make, lambda n, length: torch.zeros(n, length, dtype=torch.long), 256, False, "")
    target = target_device("H100", None, None)
    p = serve_policy("bf16")
    shapes = [Shape(20, 12, 2), Shape(20, 40, 2), Shape(8, 4, 3)]
    run = PolicyRun(ServeForecaster(served, target, 0), p, {})
    lines = [run.traced(shape) for shape in shapes]  # the first finds a block exact; the others take the shortcut
    monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 10)
    for shape, line in zip(shapes, lines, strict=True):
        whole = PolicyRun(ServeForecaster(served, target, 0), p, {}).traced(shape)
        for a, b in ((line.prefill, whole.prefill), (line.decode, whole.decode)):
            assert (a.peak, a.weights, a.kv) == (b.peak, b.weights, b.kv), shape
        assert whole.decode.kv == cache_bytes_at(config, p.kv, torch.bfloat16, shape.context, shape.batch_size)


def test_a_search_stays_within_the_models_positions_and_never_costs_the_answer(monkeypatch):
    """The longest-context search goes up to the positions the model serves (a sliding-window model's cache stops
    growing at its window, so it fits there); a search that cannot be traced leaves its figure out, saying why, and
    the answer at the shape asked for stands."""
    import dtypelab.serving.speed as speed
    from dtypelab.serving.fake_serve import ServeForecaster
    from dtypelab.serving.served import Served

    config = _sliding("mistral", layers=2, window=16)

    def make():
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(config)

    served = Served("sliding", make, lambda n, length: torch.zeros(n, length, dtype=torch.long), 256, False, "")
    target = target_device("H100", None, None)
    figures, notes = speed.policy_figures(ServeForecaster(served, target, 0), serve_policy("bf16"), Shape(20, 12, 2),
                                          None, {}, True)
    assert figures.longest_context == 256 and figures.largest_batch and notes == ()

    def refused(*args, **kwargs):
        raise DtypelabError("a context of 4096 tokens is refused")

    monkeypatch.setattr(speed, "largest_batch", refused)
    figures, notes = speed.policy_figures(ServeForecaster(served, target, 0), serve_policy("bf16"), Shape(20, 12, 2),
                                          None, {}, True)
    assert figures.peak_bytes and figures.longest_context is None and figures.largest_batch is None
    assert notes == ("largest batch not searched: a context of 4096 tokens is refused",
                     "longest context not searched: a context of 4096 tokens is refused")


# --- the forecast ---------------------------------------------------------------------------------------------------
def _measured_memory(policy: str, shape: Shape) -> dict:
    from dtypelab.core.policies import Precision
    from dtypelab.serving.measure import GenerateJob, counted, prompts
    from dtypelab.serving.served import load_served
    from dtypelab.serving.workload import compute_dtype

    served = load_served("tinylm")
    p = serve_policy(policy)
    model = served.make_model().eval()
    config = model.config
    precision = Precision(p.plan, "cpu")
    model = precision.convert_module(model)
    job = GenerateJob("tinylm", p.plan, p.kv.label, policy, shape, 1, 1, 8, 0, "cpu")
    with precision.session(), torch.no_grad():
        dtype = compute_dtype(model, config, torch.device("cpu"))
        return counted(model, config, job, prompts(served.text, shape), dtype, torch.device("cpu"))


@pytest.mark.parametrize("policy", ["fp32", "bf16", "int8-wo", "fp32+kv-int8", "bf16+kv-fp8"])
def test_the_traced_workload_holds_what_the_same_workload_holds_on_real_tensors(policy):
    """The forecast for this CPU (fake tensors) against the ledger on the real prefill and decode: weights and cache
    to the byte, the peaks within 0.5% (the prompt's ids are counted on one side only)."""
    from dtypelab.serving.fake_serve import PolicyRun, ServeForecaster
    from dtypelab.serving.served import load_served

    shape = Shape(48, 16, 3)
    fc = ServeForecaster(load_served("tinylm"), target_device("cpu", None, None), 0)
    traced = PolicyRun(fc, serve_policy(policy), {}).traced(shape)
    real = _measured_memory(policy, shape)
    assert traced.decode.weights == real["weights"]
    assert traced.decode.kv == real["kv"]
    assert traced.prefill.peak == pytest.approx(real["prefill"].total, rel=5e-3)
    assert traced.decode.peak == pytest.approx(real["decode"].total, rel=5e-3)


@pytest.mark.parametrize("policy,device", [("bf16", "H100"), ("int8-wo+kv-int8", "H100"), ("fp32+kv-fp8", "cpu")])
def test_a_deep_model_read_off_two_shallow_traces_is_its_whole_trace(policy, device, monkeypatch):
    """Seven blocks: the line through the traces at 3 and 4 blocks gives the whole trace's peaks, weights and cache
    to the byte, and the same decode time (within 1e-6)."""
    import dtypelab.forecasting.depth as fcmod
    from dtypelab.serving.fake_serve import PolicyRun, ServeForecaster
    from dtypelab.serving.served import Served
    from dtypelab.serving.speed import policy_figures

    _, config = tiny_llama(layers=7)

    def make():
        from transformers import LlamaForCausalLM
        return LlamaForCausalLM(config)

    served = Served("tiny7", make, lambda n, length: torch.zeros(n, length, dtype=torch.long), 128, False, "")
    target = target_device(device, None, None)
    shape = Shape(20, 12, 2)
    p = serve_policy(policy)
    monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 7)  # read off at 7 (a user's model: from 10 blocks)
    deep = ServeForecaster(served, target, 0)
    line = PolicyRun(deep, p, {}).traced(shape)
    monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 8)
    whole = PolicyRun(ServeForecaster(served, target, 0), p, {}).traced(shape)
    for a, b in ((line.prefill, whole.prefill), (line.decode, whole.decode)):
        assert (a.peak, a.weights, a.kv) == (b.peak, b.weights, b.kv)
    if device != "cpu":  # this CPU's time model times each kernel here: not the same twice
        from dtypelab.forecasting import StepTimes, rates_for

        rates, _ = rates_for(target)
        monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 7)
        f_line, _ = policy_figures(ServeForecaster(served, target, 0), p, shape, StepTimes(rates), {}, False)
        monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 8)
        f_whole, _ = policy_figures(ServeForecaster(served, target, 0), p, shape, StepTimes(rates), {}, False)
        assert f_line.token_latency_s == pytest.approx(f_whole.token_latency_s, rel=1e-6)
        assert f_line.ttft_s == pytest.approx(f_whole.ttft_s, rel=1e-6)
        # the searches (largest batch, longest context) trace other sizes: the speed is still the job's shape's
        monkeypatch.setattr(fcmod, "DEEP_ENOUGH", 7)
        searched, _ = policy_figures(ServeForecaster(served, target, 0), p, shape, StepTimes(rates), {}, True)
        assert searched.largest_batch and searched.longest_context
        assert searched.token_latency_s == pytest.approx(f_line.token_latency_s, rel=1e-6)


def test_the_largest_size_is_what_brute_force_finds():
    """Against brute force, on peaks linear in the size, rounded up per allocation (as CUDA's allocator does) and with
    a cap: the search serving uses (training's, ``largest_batch``, from the job's size up to the cap) answers the
    largest that fits, or None."""
    from dtypelab.forecasting.search import largest_batch

    rng = random.Random(0)
    for _ in range(300):
        base, per, block = rng.randint(0, 10**6), rng.randint(1, 10**4), rng.choice([1, 512])
        most, at = rng.randint(1, 3000), rng.randint(1, 40)
        at = min(at, most)

        def peak(n: int, base=base, per=per, block=block) -> int:
            return base + sum(-(-per * n // block) * block for _ in range(3))

        limit = rng.randint(0, peak(most) * 2)
        fits = [n for n in range(1, most + 1) if peak(n) <= limit]
        assert largest_batch(peak, limit, at, cap=most).largest == (max(fits) if fits else None)


def test_a_quantized_layer_on_a_gpu_reads_its_stored_bytes_at_its_kernels_share():
    from dtypelab.core.machine.speed import Op
    from dtypelab.serving.kernels import KERNELS
    from dtypelab.serving.speed import gpu_ops

    ops = (Op("elementwise", "", 10, ((1, 64),), ((2, 64),), module="norm"),
           Op("elementwise", "bfloat16", 0, ((3, 4096),), ((4, 8192),), module="fc"),  # the dequantization
           Op("matmuls", "bfloat16", 2 * 64 * 64, ((2, 128), (4, 8192)), ((5, 128),), 64 * 64, module="fc"))
    out = gpu_ops(ops, {"fc": "int4-weight-only"}, {"fc": 2048})
    assert len(out) == 2 and out[0] is ops[0]
    fc = out[1]
    kernel = KERNELS["int4-weight-only"]
    assert fc.rate == kernel.rate and fc.flops == 2 * 64 * 64 and fc.written == 128
    assert fc.read == 128 + int(2048 / kernel.share)


@pytest.mark.e2e
def test_a_gpu_forecast_of_an_8b_model_fits_where_its_bytes_say(tmp_path):
    """Llama-3-8B's config on an RTX 4090, batch 16, 640 tokens: weights as its parameters say (bf16: 2 bytes each),
    the cache as grouped-query attention stores it (8 of 32 heads), fits and largest batches ordered by bytes."""
    from dtypelab.serving import serve_forecast

    report = serve_forecast(f"hf:{os.path.join(ROOT, 'benchmarks', 'configs', 'llama3-8b')}", prompt_len=512,
                            gen_len=128, batch_size=16, device="RTX4090", policies="bf16,int4-wo,bf16+kv-fp8",
                            speed=False, launcher="inline")
    bf16, int4, fp8kv = (report.result(n).generate for n in ("bf16", "int4-wo", "bf16+kv-fp8"))
    # its 8,030,261,248 parameters in bfloat16, and the rotary table (a buffer) in CUDA's 512-byte blocks
    assert 0 <= bf16.weights_bytes - 8_030_261_248 * 2 <= 2 * 512
    assert bf16.kv_cache_bytes == 32 * 2 * 8 * 128 * 2 * 16 * 640
    assert fp8kv.kv_cache_bytes == bf16.kv_cache_bytes // 2 + 32 * 2 * 8 * 4
    assert int4.weights_bytes < bf16.weights_bytes / 3
    assert bf16.fits and bf16.largest_batch < fp8kv.largest_batch < int4.largest_batch
    assert bf16.longest_context < int4.longest_context
    assert report.config.source == "forecast" and report.chosen


# --- the measured sweep ---------------------------------------------------------------------------------------------
def _figures(decode_runs, disturbed=()) -> GenerateFigures:
    """A policy's rounds: round r's decode seconds ``decode_runs[r]`` (its prefill 0.01 s), ``disturbed`` those a
    busy neighbour overlapped."""
    from dtypelab.core.results import RoundBlock

    blocks = tuple(RoundBlock(round=r, median_s=0.01 + d, n=1, disturbed=r in disturbed)
                   for r, d in enumerate(decode_runs))
    return GenerateFigures(peak_bytes=1000, kv_bytes_per_token=10, decode_tok_s=100 / sorted(decode_runs)[1],
                           ttft_runs_s=(0.01,) * len(decode_runs), decode_runs_s=tuple(decode_runs), blocks=blocks,
                           disturbed_runs=len(disturbed), token_latency_s=0.01, ttft_s=0.01)


def test_a_policy_is_chosen_only_when_its_paired_interval_clears_the_no_gain_band_and_its_perplexity_holds():
    """bench's rule (core.judging.generate): the baseline's seconds over the policy's, round by round, with a
    Student-t interval; chosen where the whole interval lies above 1.02x and the perplexity is within the tolerance.
    A policy faster on average whose rounds swing (b) has an interval reaching below the band: no gain."""
    from dtypelab.core.judging.generate import judge_generation
    from dtypelab.core.results import Decision, Verdict
    from dtypelab.core.tolerance import Tolerance

    base = GeneratePolicy("fp32", "", "ok", generate=_figures((1.0, 1.02, 1.01, 0.99, 1.0)),
                          quality=GenerateQuality(10.0))
    clear = GeneratePolicy("a", "", "ok", generate=_figures((0.5, 0.52, 0.51, 0.5, 0.49)),
                           quality=GenerateQuality(10.05))
    swings = GeneratePolicy("b", "", "ok", generate=_figures((0.3, 1.3, 0.31, 1.2, 0.9)), quality=GenerateQuality(10.0))
    worse = GeneratePolicy("c", "", "ok", generate=_figures((0.1,) * 5), quality=GenerateQuality(10.5))
    judged = judge_generation([base, clear, swings, worse], "fp32", Tolerance.parse("1%"), "decode", 8)
    assert judged.chosen == "a" and judged.decision == Decision.USE and judged.sentence.startswith("a: the fastest")
    verdicts = {p.policy: p.verdict for p in judged.policies}
    assert verdicts == {"fp32": Verdict.BASELINE, "a": Verdict.RECOMMENDED, "b": Verdict.NO_GAIN,
                        "c": Verdict.OUTSIDE}
    a = judged.policies[1].gain
    assert a.rounds == 5 and 1.9 < a.low < a.point < a.high < 2.1
    assert judged.policies[2].gain.low < 1.02 < judged.policies[2].gain.point
    kept = judge_generation([base, swings], "fp32", Tolerance.parse("1%"), "decode", 8)
    assert kept.chosen == "fp32" and kept.decision == Decision.KEEP_BASELINE
    untimed = replace(clear, generate=replace(clear.generate, blocks=(), ttft_runs_s=(), decode_runs_s=()))
    assert judge_generation([base, untimed], "fp32", Tolerance.parse("1%"), "decode", 8).policies[1].verdict == \
        Verdict.UNTIMED


def test_the_measured_sweep_of_the_small_model(tmp_path):
    """tinylm, four policies inline: the record's fields, the baseline's quality against itself, a GPU-only format
    skipped with its reason, and the record read back and drawn."""
    from dtypelab.core.results import Verdict

    report = serve_bench("tinylm", prompt_len=24, gen_len=8, batch_size=2, policies="fp32,int8-wo+kv-int8,int4-wo",
                         launcher="inline", json_path=str(tmp_path / "g.json"))
    base, small, gpu = report.policies
    assert base.verdict == Verdict.BASELINE and small.gain is not None and small.gain.rounds + small.gain.dropped == 5
    assert base.quality.perplexity < 20  # a trained model on real text (bytes: 256 would be a guess)
    g = small.generate
    assert g.weights_bytes < base.generate.weights_bytes / 3 and g.kv_cache_bytes < base.generate.kv_cache_bytes / 3
    assert g.peak_bytes >= g.weights_bytes + g.kv_cache_bytes and g.decode_tok_s > 0 and g.prefill_tok_s > 0
    assert len(g.decode_runs_s) == len(g.blocks) == 5 and 0 < small.quality.agreement <= 1
    assert abs(small.quality.perplexity_change) < 0.05
    # int4-wo's kernel is CUDA's: measured as its emulation, numerics only, never timed
    assert gpu.status == "ok" and gpu.measured_as == "int4-wo-emu" and "numerics only" in gpu.notes[0]
    assert gpu.generate.decode_runs_s == () and gpu.quality.kl is not None and gpu.quality.kl.low <= gpu.quality.kl.high
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["schema"] == "dtypelab.generate"
    assert data["policies"][1]["generate"]["kv_cache_bytes"] == g.kv_cache_bytes
    shown = dtypelab("show", str(tmp_path / "g.json"))
    assert shown.returncode == 0 and "int8-wo+kv-int8" in shown.stdout and "perplexity" in shown.stdout


def test_the_check_compares_with_the_fastest_timed_generation():
    from dtypelab.serving.forecast import _fastest

    g = GenerateFigures(ttft_s=0.02, decode_tok_s=10.0, ttft_runs_s=(0.03, 0.01, 0.02), decode_runs_s=(0.9, 0.7, 0.8))
    got = _fastest(g, Shape(10, 8, 2))
    assert got.ttft_s == 0.01 and got.prefill_tok_s == pytest.approx(2 * 10 / 0.01)
    assert got.decode_tok_s == pytest.approx(2 * 7 / 0.7) and got.token_latency_s == pytest.approx(0.1)


def test_a_layer_the_int4_kernel_cannot_take_keeps_its_weights():
    """torchao leaves a Linear whose input width is not whole groups of 128 as it is: the forecast counts its
    bfloat16 bytes, not int4's."""
    from dtypelab.serving.fake_serve import quantized_layers

    model, _ = tiny_llama()  # width 64; the MLP's down projection takes 128 inputs: one whole group
    int4 = quantized_layers(serve_policy("int4-wo").plan, model)
    assert set(int4) == {f"model.layers.{i}.mlp.down_proj" for i in (0, 1)}
    assert len(quantized_layers(serve_policy("int8-wo").plan, model)) == 2 * 7 + 1  # every Linear, the head included


# --- inputs that do not apply, and errors in one line --------------------------------------------------------------
def _config_dir(tmp_path, **changes):
    """Mistral-7B-v0.1's published config with ``changes`` (a key set to None is removed)."""
    with open(os.path.join(ROOT, "benchmarks", "configs", "mistral-7b-v0.1", "config.json")) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}"


@pytest.mark.parametrize("changes,words", [
    ({"hidden_size": None, "num_hidden_layers": None}, "has no hidden_size, num_hidden_layers: transformers would "
                                                       "build its default model"),
    ({"num_hidden_layers": -2}, "num_hidden_layers is -2: it must be a whole number of at least 1"),
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    ({"num_key_value_heads": 5}, "num_attention_heads (32) is not a multiple of num_key_value_heads (5)"),
    ({"hidden_size": "big"}, "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int"),
    ({"architectures": ["BertModel"], "model_type": "bert"}, "is a bert model, not a causal language model"),
])
def test_a_config_the_model_cannot_be_built_from_is_one_line(tmp_path, changes, words):
    got = dtypelab("forecast", _config_dir(tmp_path, **changes), "--mode", "generate", "--device", "H100",
                   "--json", str(tmp_path / "r.json"))
    assert got.returncode == 2 and "Traceback" not in got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], got.stderr


@pytest.mark.parametrize("args,words", [
    (["--nproc", "2"], "--nproc does not apply to --mode generate"),
    (["--lora-rank", "4", "--seq-len", "64"], "--lora-rank, --seq-len do not apply to --mode generate"),
    (["--objective", "speed"], "--objective speed is not forecast for --mode generate"),
    (["-p", "kv-fp8"], "a KV format modifies a weight format"),
    (["-p", "bf16+kv-fp8+kv-int8"], "one KV-cache format at most"),
])
def test_a_generate_forecast_refuses_what_does_not_apply(tmp_path, args, words):
    got = dtypelab("forecast", "tinylm", "--mode", "generate", "--device", "H100", *args)
    assert got.returncode == 2 and words in got.stderr and "Traceback" not in got.stderr


@pytest.mark.parametrize("args,words", [
    (["--prompt-len", "64"], "--prompt-len does not apply to --mode step"),
    (["--objective", "latency"], "--objective latency is not forecast for --mode step: use speed"),
    (["--objective", "energy"], "--objective energy is not forecast for --mode step"),
    (["--lora-alpha", "inf"], "lora_alpha"),
    (["-p", "bf16+kv-fp8"], "'kv-fp8' is a KV-cache format: it modifies a weight format under --mode generate"),
    (["-p", "bf16+turbo"], "unknown modifier '+turbo'; modifiers: +compile, +ckpt, +chunked-ce"),
    (["-p", "bf16+chunked-ce-3"], "unknown modifier '+chunked-ce-3'"),
    (["-p", "bfl16"], "unknown policy 'bfl16' (did you mean 'bf16'"),
])
def test_a_step_forecast_refuses_what_does_not_apply_in_one_short_line(args, words):
    got = dtypelab("forecast", "digits", "--device", "H100", "--no-speed", *args)
    errors = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert got.returncode == 2 and len(errors) == 1 and words in errors[0], got.stderr
    assert len(errors[0]) < 400  # no list of every policy's name


def test_modifiers_combine_in_any_order_and_policies_lists_them():
    from dtypelab.core.policies import get_policy

    for name in ("fp32+ckpt+compile", "fp32+compile+ckpt"):
        plan = get_policy(name)
        assert plan.compiles and plan.checkpoint
    assert serve_policy("bf16+kv-fp8+compile").kv.label == "kv-fp8"
    assert serve_policy("bf16+kv-fp8+compile").plan.compiles
    listed = " ".join(dtypelab("policies").stdout.split())
    for modifier in ("+ckpt", "+chunked-ce", "NAME+kv-FORMAT", "+compile", "+adam8bit", "+fsdp"):
        assert modifier in listed


def test_a_forecast_without_memory_to_fit_says_no_policy_fits_nothing(tmp_path):
    """No --device (or --memory 0: no limit): the answer names the smallest peak and never speaks of fitting; a
    quantization_config the policies do not apply is said; --objective decides the answer and is recorded."""
    from dtypelab.core.records import load_record

    spec = _config_dir(tmp_path, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    got = dtypelab("forecast", spec, "--mode", "generate", "-p", "bf16,int8-wo", "--no-batch-search",
                   "--json", str(tmp_path / "a.json"))
    said = " ".join(got.stdout.split())
    answer = load_record(str(tmp_path / "a.json")).answer
    assert got.returncode == 0 and "fits" not in answer and answer.endswith("(no memory to fit: give --device or "
                                                                            "--memory)")
    assert "quantization_config (awq, 4-bit, groups of 128) is not applied" in said
    got = dtypelab("forecast", "tinylm", "--mode", "generate", "--device", "H100", "--objective", "prefill",
                   "--json", str(tmp_path / "b.json"))
    record = load_record(str(tmp_path / "b.json"))
    fastest = max((p for p in record.policies if p.generate and p.generate.prefill_tok_s),
                  key=lambda p: p.generate.prefill_tok_s)
    # within the serve-speed band of the fastest is a tie, which the widest weights win (the safer numerics)
    e = record.ratio_error
    close = [p for p in record.policies if p.generate and p.generate.prefill_tok_s
             and p.generate.prefill_tok_s * (1 + e) >= fastest.generate.prefill_tok_s * (1 - e)]
    chosen = max(close, key=lambda p: (p.generate.weights_bytes, p.generate.prefill_tok_s))
    assert record.config.objective == "prefill" and record.answer.startswith(f"{chosen.policy}: the fastest prefill")
    assert e > 0 and (len(close) == 1 or "a tie, broken by the wider weights" in record.answer)


def test_a_forecast_writes_no_librarys_import_noise_to_stderr(tmp_path):
    """torchao's kernels built for another GPU ("Failed to load …_C_mxfp8….so") and torch's deprecation warnings,
    logged when a model's module is first imported (here, and in the tracing workers): not the user's to read."""
    config = _sliding("gemma2", layers=8).to_dict()  # deep: built at the depths it is traced at
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma2ForCausalLM"]}))
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-m", "dtypelab", "forecast", f"hf:{tmp_path / 'g'}", "--mode", "generate",
                          "--device", "H100", "-p", "bf16,int4-wo,int8-wo", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)  # a process of its own: nothing imported yet
    assert got.returncode == 0, got.stderr
    noise = [line for line in got.stderr.splitlines() if not line.startswith(("[", "results saved", "dtypelab-",
                                                                               "re-render", "/"))]
    assert not any("Failed to load" in line or "_pytree" in line or line.startswith("W1") for line in noise), noise


def test_a_narrow_generate_table_keeps_its_objectives_columns_and_says_reasons_in_notes(tmp_path):
    import subprocess
    import sys

    from dtypelab.render.generate import _ms, generate_doc, narrow_order

    assert (_ms(10.1), _ms(0.00123)) == ("10,100", "1.23")  # never 1.01e+04
    path = tmp_path / "r.json"
    dtypelab("forecast", "tinylm", "--mode", "generate", "--device", "A100-80GB", "-p", "bf16,fp8-dyn-row",
             "--objective", "latency", "--json", str(path))
    from dtypelab.core.records import load_record

    record = load_record(str(path))
    order = narrow_order(record)
    assert order[-2:] == ("TTFT", "ms/token") and order.index("KV cache") > order.index("J/token")
    _, _, rows, notes = generate_doc(record)
    fp8 = next(r for r in rows if r[0] == "fp8-dyn-row")
    assert fp8[-1] == "not timed" and any(n.startswith("fp8-dyn-row: not timed: no fp8 rate on") for n in notes)
    shown = subprocess.run([sys.executable, "-m", "dtypelab", "show", str(path)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "COLUMNS": "80"})
    head = "".join(shown.stdout.splitlines()[2:6])
    assert "TTFT" in head and "ms/token" in head and max(len(line) for line in shown.stdout.splitlines()) <= 80


def test_a_generation_timed_beside_a_busy_process_is_said_and_decides_nothing():
    """Beside a busy process fp32's generations ran 10x slow and fp32+kv-bf16's quietly: "12.79x faster" was chosen.
    Disturbed rounds are left out of the pairing while three quiet ones remain; a gain that rests on a disturbed
    round is no gain, and the record says which were disturbed and which rounds spread past 2x."""
    from dtypelab.core.judging.generate import judge_generation, steadiness_notes
    from dtypelab.core.results import Verdict
    from dtypelab.core.tolerance import Tolerance
    from dtypelab.render.generate import verdict_text

    def policy(name: str, runs: tuple[float, ...], disturbed: tuple[int, ...] = ()) -> GeneratePolicy:
        return GeneratePolicy(name, "", "ok", generate=_figures(runs, disturbed),
                              quality=GenerateQuality(6.0, 0.0, 1.0, 8.0, 0, 4))

    tol = Tolerance.parse("1%")
    base = policy("fp32", (10.0, 12.0, 11.0), disturbed=(0, 1, 2))
    quiet = policy("fp32+kv-bf16", (0.8, 0.9, 0.85))
    judged = judge_generation([base, quiet], "fp32", tol, "decode", 64)
    assert judged.chosen == "fp32" and judged.policies[1].verdict == Verdict.NO_GAIN and "no policy" in judged.sentence
    assert verdict_text(judged.policies[1], judged.decision).endswith(", disturbed")
    notes = steadiness_notes(list(judged.policies), "decode")
    assert notes[0].startswith("other processes took the CPU while fp32 was timed")
    calm = policy("fp32", (10.0, 12.0, 11.0, 11.0, 10.5), disturbed=(3, 4))  # three quiet rounds: those decide
    judged = judge_generation([calm, policy("fp32+kv-bf16", (0.8, 0.9, 0.85, 9.0, 9.0))], "fp32", tol, "decode", 64)
    assert judged.chosen == "fp32+kv-bf16" and judged.policies[1].gain.dropped == 2
    shaky = policy("int8-dyn", (16.0, 5.4, 0.78))
    assert steadiness_notes([shaky], "decode") == ["unsteady timings (slowest over fastest round): int8-dyn 20.5x"]


@pytest.mark.parametrize("mode", ["generate", "step"])
def test_memory_zero_is_refused_not_read_as_no_limit(mode):
    got = dtypelab("forecast", "tinylm" if mode == "generate" else "digits", "--mode", mode, "--device", "H100",
                   "--memory", "0")
    assert got.returncode == 2 and "--memory 0: give the memory to fit" in got.stderr


@pytest.mark.parametrize("policy", ["int4-wo", "fp8-dyn-row", "fp8-dyn-tensor"])
def test_training_and_serving_forecasts_store_a_formats_weights_in_the_same_bytes(policy):
    """One answer for a stand-in's weight bytes (``STORED_WEIGHT_BYTES``): Llama-2-7B's layers at two blocks, as the
    training forecast's stand-in counts them and as serving's conversion and its kernels' reads do, to the byte
    (int4's tinygemm layout pads ``down_proj``'s 11008 inputs to 11264: 24.51 MB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtypelab.core.policies import get_policy
    from dtypelab.forecasting import CUDA_BLOCK
    from dtypelab.forecasting.adapters import STORED_WEIGHT_BYTES
    from dtypelab.forecasting.layouts import stand_in
    from dtypelab.serving.fake_serve import convert, quantized_layers

    config = AutoConfig.from_pretrained(os.path.join(ROOT, "benchmarks", "configs", "llama2-7b"), num_hidden_layers=2)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    plan = get_policy(policy)
    _, training = stand_in(plan, meta, RuntimeError("needs CUDA"), CUDA_BLOCK)
    _, serving, layers = convert(plan, meta, cuda=True)
    assert layers == quantized_layers(plan, meta) and len(layers) == 2 * 7 + 1  # and the head
    assert serving == training != 0
    if policy == "int4-wo":
        down = meta.get_submodule("model.layers.0.mlp.down_proj")
        assert STORED_WEIGHT_BYTES(plan.default, down) == 4096 * 11264 // 2 + 88 * 4096 * 4 == 24_510_464


def test_ctrl_c_keeps_the_serving_policies_forecast_so_far_and_marks_the_rest_interrupted(tmp_path, monkeypatch):
    """Ctrl-C during a serving forecast (here, as the second policy starts): the record is saved with the first
    policy's forecast and the others interrupted, and the interruption reaches the caller (the CLI exits 130)."""
    import dtypelab.serving.forecast as fc
    from dtypelab.core.records import load_record
    from dtypelab.serving import serve_forecast

    real, calls = fc._forecast_one, []

    def one(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(fc, "_forecast_one", one)
    path = tmp_path / "g.json"
    with pytest.raises(KeyboardInterrupt):
        serve_forecast("tinylm", prompt_len=16, gen_len=8, device="cpu", policies="fp32,bf16,int8-wo", speed=False,
                       batch_search=False, launcher="inline", json_path=str(path))
    status = {p.policy: p.status for p in load_record(str(path)).policies}
    assert status == {"fp32": "ok", "bf16": "interrupted", "int8-wo": "interrupted"}


def test_a_version_2_generate_record_reads_its_verdict_words_as_codes(tmp_path):
    """Version 2 said each verdict in words ("within, tie", "baseline, kept"): read back as version 3's codes, and
    its decision from what it chose."""
    from dtypelab.core.records import load_record
    from dtypelab.core.results import Decision, Verdict

    config = {"task": "tinylm", "task_name": "tinylm", "source": "measured", "prompt_len": 8, "gen_len": 4,
              "batch_size": 1, "baseline": "fp32"}
    words = {"fp32": "baseline, kept", "bf16": "within, tie", "int8-wo": "worse, disturbed", "fp8-wo": "within"}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"schema": "dtypelab.generate", "schema_version": 2, "config": config, "chosen": "fp32",
                                "policies": [{"policy": p, "summary": "", "status": "ok", "verdict": w}
                                             for p, w in words.items()]}))
    record = load_record(str(path))
    assert record.decision == Decision.KEEP_BASELINE
    assert [p.verdict for p in record.policies] == [Verdict.BASELINE, Verdict.NO_GAIN, Verdict.OUTSIDE, Verdict.WITHIN]


def test_a_kv_format_added_in_one_file_is_forecast_and_measured(tmp_path, monkeypatch):
    """A KV format is its kind's registration in one file (here fp8 e4m3 with a scale per token and head, a file of
    its own imported as a kind module is): nothing else names it, yet the forecast counts its bytes by the formula
    and the measured sweep stores, reads back and judges it."""
    import importlib.util

    from dtypelab.core.policies import registry
    from dtypelab.serving import serve_forecast
    from dtypelab.serving.kv import layer_bytes_per_token

    monkeypatch.setattr(registry, "KV_FORMATS", dict(registry.KV_FORMATS))
    monkeypatch.setattr(registry, "DEFAULTS", {k: list(v) for k, v in registry.DEFAULTS.items()})
    import dtypelab.serving.kv as kvmod

    monkeypatch.setattr(kvmod, "FORMATS", registry.KV_FORMATS)
    path = tmp_path / "kv_fp8_token.py"
    path.write_text("import torch\n"
                    "from dtypelab.core.policies.kinds.kv_cache import PerToken\n"
                    "from dtypelab.core.policies.registry import register_kv\n"
                    "register_kv(PerToken('kv-fp8-token', torch.float8_e4m3fn, 'keys and values in fp8 e4m3, a "
                    "float32 scale per token and head'))\n")
    spec = importlib.util.spec_from_file_location("kv_fp8_token", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    fmt = kv_format("kv-fp8-token")
    _, config = tiny_llama()
    assert layer_bytes_per_token(config, fmt, torch.float32) == 2 * 2 * 16 * 1 + 2 * 2 * 4  # codes + scales
    forecast = serve_forecast("tinylm", prompt_len=16, gen_len=8, device="H100", policies="bf16,bf16+kv-fp8-token",
                              batch_search=False, speed=False, launcher="inline")
    bf16, fp8 = (forecast.result(n).generate for n in ("bf16", "bf16+kv-fp8-token"))
    assert bf16.kv_cache_bytes > fp8.kv_cache_bytes > bf16.kv_cache_bytes // 2
    measured = serve_bench("tinylm", prompt_len=16, gen_len=8, batch_size=2, policies="fp32,fp32+kv-fp8-token",
                           launcher="inline", rounds=3)
    token = measured.result("fp32+kv-fp8-token")
    assert token.status == "ok" and abs(token.quality.perplexity_change) < 0.05 and token.verdict is not None


def test_a_format_without_a_published_kernel_share_is_timed_as_a_bf16_gemm_and_says_so():
    """A quantization scheme just added (its layout and kernel key said by its kind, ``Quantize.stored_bytes`` and
    ``Quantize.kernel``) has no fitted share in ``KERNELS``: timed as a bfloat16 GEMM reading its stored bytes."""
    from dtypelab.serving.kernels import AS_BF16, KERNELS, kernel_of

    assert kernel_of("int4-weight-only") is KERNELS["int4-weight-only"]
    assert kernel_of("int3-weight-only") is AS_BF16 and AS_BF16.share == 1.0 and "no published" in AS_BF16.name


@pytest.mark.parametrize("args,said", [
    (["--mode", "generate", "--steps", "5"], "--steps does not apply to --mode generate: leave it out"),
    (["--mode", "generate", "--runs", "3", "--profile"], "--runs, --profile do not apply to --mode generate"),
    (["--prompt-len", "16"], "--prompt-len does not apply to --mode train: leave it out"),
    (["--mode", "generate", "--launcher", "slurm"], "--launcher slurm: --mode generate measures each serving policy"),
])
def test_an_option_a_mode_does_not_read_is_refused_not_ignored(args, said):
    got = dtypelab("bench", "tinylm", *args)
    assert got.returncode == 2 and said in " ".join(got.stderr.split()), got.stderr
