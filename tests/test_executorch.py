"""ExecuTorch policies: a model exported to a .pte for the XNNPACK delegate and run by ExecuTorch's runtime here,
measured like any policy; export writes the program with its metadata beside it, and reading it back runs no code."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TINY, fake_hardware
from torch import nn

pytest.importorskip("executorch", reason="the [device] extra (ExecuTorch) is not installed")

from dtypelab import bench, get_policy
from dtypelab.core import executorch as et
from dtypelab.core.errors import DtypelabError
from dtypelab.core.judging.notes import _op_name
from dtypelab.inference import export, load_exported
from dtypelab.inference.fidelity import sqnr_db


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()


def _calls(n: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(16, 64, generator=g),), {}) for _ in range(n)]


@pytest.mark.parametrize("scheme, floor_db", [("fp32", 90), ("fp16", 40), ("int8-dyn", 25), ("int8", 20),
                                              ("8da4w", 10)])
def test_each_scheme_runs_in_the_runtime_close_to_the_eager_model(scheme, floor_db):
    model, calls = _mlp(), _calls()
    x = calls[0][0][0]
    with torch.no_grad():
        ref = model(x)
    program = et.PteModule(et.lower(_mlp(), scheme, calls))
    got = program(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # fp32 is XNNPACK's own float32 arithmetic (not bit-equal to torch's); the others lose their format's share
    assert floor_db < sqnr_db(ref, got) < (200 if scheme == "fp32" else 80), scheme
    assert program.lowered.delegated >= 1 and len(program.program) > 1000


def test_a_call_of_another_batch_is_padded_or_chunked_to_the_programs():
    program = et.PteModule(et.lower(_mlp(), "fp32", _calls(1)))  # exported at 16 rows
    x = torch.randn(37, 64)
    whole = program(x)
    assert whole.shape == (37, 32)
    parts = torch.cat([program(x[i:i + 1]) for i in range(37)])  # one row, padded to 16
    assert torch.equal(whole, parts)


class _Indexed(nn.Module):
    """Integer index arithmetic beside a linear layer, as transformers' attention masks do (arange + 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0]) + 0
        return self.lin(x)[rows]


def test_integer_scalars_survive_the_int8_quantizer():
    """ExecuTorch 1.5's XNNPACKQuantizer makes every add/mul scalar a float tensor: an integer index then fails."""
    torch.manual_seed(0)
    model, x = _Indexed().eval(), torch.randn(8, 16)
    with torch.no_grad():
        ref = model(x)
    program = et.PteModule(et.lower(copy.deepcopy(model), "int8-dyn", [((x,), {})]))
    assert sqnr_db(ref, program(x)) > 20


def test_without_example_inputs_the_policy_says_so():
    with pytest.raises(DtypelabError, match="example inputs"):
        et.example_calls(_mlp(), None)


def test_the_kind_is_the_whole_model_on_the_cpu():
    plan = get_policy("et-int8")
    assert plan.default.facts.modes == ("infer",)
    hw = fake_hardware()
    assert plan.default.supported(hw) is None
    assert "--device cpu" in plan.default.supported(fake_hardware(device="cuda"))
    from dtypelab.core.policies import Plan

    with pytest.raises(DtypelabError, match=r"exports the whole model to one \.pte"):
        Plan(get_policy("fp32").default, (("net.0", plan.default),), name="mixed")


def test_missing_executorch_is_one_line_with_its_setup(monkeypatch):
    monkeypatch.setattr(et.importlib.util, "find_spec", lambda name: None)
    why = et.missing()
    assert why is not None and et.SETUP in why and "\n" not in why


def test_bench_measures_the_programs_like_any_policy(monkeypatch):
    # a program this small is slower than eager (the runtime's fixed cost): timed in the rounds all the same
    monkeypatch.setattr("dtypelab.sweep.rounds.CLEARLY_SLOWER", 0.0)
    report = bench(f"{TINY}:make_task", "et-fp32,et-int8-dyn", mode="infer", steps=6, rounds=2, isolate=False,
                   hardware=fake_hardware())
    for name in ("et-fp32", "et-int8-dyn"):
        r = report.result(name)
        assert r.status == "ok", r.reason
        assert r.size["format"] == "executorch .pte" and r.size["linear_weight_bytes"] is None
        assert r.conversion["delegate"] == "XNNPACK" and r.conversion["delegated"] >= 1
        assert len(r.rounds) >= 2  # timed in the interleaved rounds beside fp32
    assert report.result("et-fp32").fidelity["sqnr_db"] > 60
    notes = " ".join(report.recommendation.notes)
    assert "the whole model as one ExecuTorch .pte program" in notes


def test_operator_keys_read_as_aten_names():
    assert _op_name("aten_native_layer_norm_default") == "native_layer_norm"
    assert _op_name("dim_order_ops__to_dim_order_copy_default") == "_to_dim_order_copy"
    assert _op_name("aten_where_self") == "where"
    assert _op_name("scalar_tensor") == "scalar_tensor"


def test_export_writes_the_program_and_reading_it_back_runs_no_code(tmp_path):
    path = str(tmp_path / "tiny.pte")
    info = export(f"{TINY}:make_task", "et-int8-dyn", path)
    assert info.format == "executorch .pte" and info.roundtrip_max_abs_diff == 0
    meta = json.loads((tmp_path / "tiny.pte.json").read_text())
    # the arena holds at least the program's float32 input rows (8 features); the delegate's insides are its own
    assert info.planned_bytes and info.planned_bytes >= meta["program"]["batch"] * 8 * 4
    assert meta["policy"] == "et-int8-dyn" and meta["program"]["batch"] >= 1
    # a file naming a task file that does not exist, or would run code: the program loads without it
    meta["task"] = str(tmp_path / "evil.py") + ":make_task"
    (tmp_path / "tiny.pte.json").write_text(json.dumps(meta))
    model, got = load_exported(path)
    assert got["task"].endswith("evil.py:make_task")
    x = torch.randn(5, 8)
    assert model(x).shape == (5, 3)


def test_a_pte_without_its_metadata_or_not_a_program_is_one_line(tmp_path):
    path = tmp_path / "x.pte"
    path.write_bytes(b"not a program")
    with pytest.raises(DtypelabError, match=r"metadata x\.pte\.json is missing"):
        load_exported(str(path))
    (tmp_path / "x.pte.json").write_text(json.dumps({"program": {"in_spec": "", "out_spec": "", "batch": 1,
                                                                 "float_dtype": "float32"}}))
    with pytest.raises(DtypelabError, match=r"x\.pte"):
        load_exported(str(path))


def test_the_commands_that_trace_or_serve_refuse_a_program_in_one_line():
    from dtypelab.core.task import load_task
    from dtypelab.forecasting.run import choose_policies
    from dtypelab.serving import serve_forecast, serve_policy
    from dtypelab.tuning.run import _candidate_error

    with pytest.raises(DtypelabError, match=r"et-int8: a ExecuTorch generation program.*latency is not forecast"):
        serve_forecast("tinylm", device="H100", policies="bf16,et-int8", launcher="inline")
    assert serve_policy("et-int8").name == "et-int8"  # bench --mode generate measures it
    assert "not a config for layers" in (_candidate_error(get_policy("et-int8-dyn"), "infer") or "")
    task = load_task(f"{TINY}:make_task")
    with pytest.raises(DtypelabError, match="a device's latency is not forecast"):
        choose_policies("fp32,et-int8", task, 1)
    assert not any(p.program for p in choose_policies("all", task, 1))  # "all" leaves them out


# --- a language model as a generation program (its cache inside) --------------------------------------------------
def _tiny_lm(layers: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def lm_program():
    from dtypelab.core.executorch_lm import Generation, PteLM, lower_lm

    return PteLM(lower_lm(_tiny_lm(), "fp32", Generation(2, 24), None))


def test_a_generation_program_prefills_and_decodes_through_its_own_cache_as_the_eager_model(lm_program):
    """Prefill 10 tokens, decode 5 one at a time, through the program's cache: every logit as the eager model's
    over the whole sequence; a call with fewer rows than the program's batch is padded."""
    ids = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _tiny_lm()(ids).logits
    for rows in (2, 1):
        cache = lm_program.new_cache(rows, 15)
        parts = [lm_program(ids[:rows, :10], past_key_values=cache, use_cache=True, logits_to_keep=0).logits]
        parts += [lm_program(ids[:rows, i:i + 1], past_key_values=cache, logits_to_keep=1).logits
                  for i in range(10, 15)]
        got = torch.cat(parts, dim=1)
        assert got.shape == (rows, 15, 97) and cache.position == 15
        assert torch.allclose(got, ref[:rows], atol=1e-4), (rows, (got - ref[:rows]).abs().max())
    # the cache's bytes: keys, values (1 layer x 2 x batch 2 x 2 heads x 24 positions x 16 dims, float32) and the
    # cache's length counters
    assert lm_program.lowered.cache_bytes == 2 * 2 * 2 * 24 * 16 * 4 + 8
    assert lm_program.lowered.planned_bytes > lm_program.lowered.cache_bytes


def test_a_generation_program_refuses_what_it_was_not_exported_for_in_one_line(lm_program):
    with pytest.raises(DtypelabError, match="exported for 2 sequences of 24 positions, not 3 of 10"):
        lm_program.new_cache(3, 10)
    cache = lm_program.new_cache(2, 24)
    lm_program(torch.zeros((2, 20), dtype=torch.long), past_key_values=cache)
    with pytest.raises(DtypelabError, match=r"holds 24 positions: 20 \+ 5 tokens do not fit"):
        lm_program(torch.zeros((2, 5), dtype=torch.long), past_key_values=cache)
    lm_program.new_cache(2, 24)  # starts the program's cache over: the old one is stale
    with pytest.raises(DtypelabError, match="holds one cache"):
        lm_program(torch.zeros((2, 1), dtype=torch.long), past_key_values=cache)
    # without a cache (a task's calls): each batch of rows from position 0, as the eager model reads them
    ids = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(lm_program(input_ids=ids).logits, _tiny_lm()(ids).logits, atol=1e-4)


def test_a_generation_program_read_back_from_its_file_takes_transformers_call(lm_program, tmp_path):
    """What export writes for a language model (its metadata says the cache's shape) loads back as a program that
    holds its cache, as data: nothing named in it is imported."""
    from dtypelab.core.executorch_lm import Generation, PteLM, generates, read_program, shape_of, write_program

    path = tmp_path / "lm.pte"
    path.write_bytes(lm_program.program)
    (tmp_path / "lm.pte.json").write_text(json.dumps({"task": str(tmp_path / "evil.py") + ":make_task",
                                                      "policy": "et-fp32", "program": lm_program.lowered.metadata()}))
    model, _ = load_exported(str(path))
    assert isinstance(model, PteLM) and model.lowered == lm_program.lowered
    write_program(lm_program.lowered, str(tmp_path / "again.pte"))  # serving's hand-over to its timing rounds
    assert read_program(str(tmp_path / "again.pte")) == lm_program.lowered
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(input_ids=ids).logits, lm_program(input_ids=ids).logits)
    # a task's calls give the program's shape: their batch, their longest length (the dynamic dimension's bound)
    assert generates(_tiny_lm()) and not generates(_mlp())
    assert shape_of([((), {"input_ids": torch.zeros(4, 10)}), ((torch.zeros(4, 12),), {})]) == Generation(4, 13)


def test_serving_measures_a_program_by_its_own_bytes():
    """The runtime allocates outside torch: the memory figures come from the program (its bytes, its arena with
    the cache inside), and the KV modifier that changes a PyTorch cache is refused for it."""
    from dtypelab.core.executorch_lm import Generation, PteLM, lower_lm
    from dtypelab.serving import serve_policy
    from dtypelab.serving.measure import memory_figures, program_memory
    from dtypelab.serving.workload import Shape

    program = PteLM(lower_lm(_tiny_lm(), "int8-dyn", Generation(1, 16), None))
    figures = memory_figures(program_memory(program), Shape(8, 4, 1))
    low = program.lowered
    assert figures.weights_bytes == len(low.program) and figures.kv_cache_bytes == low.cache_bytes
    assert figures.peak_bytes == len(low.program) + low.planned_bytes
    assert figures.kv_bytes_per_token == low.cache_bytes // 16  # its cache holds 16 positions, not the shape's 12
    assert serve_policy("et-int8").plan.program == "ExecuTorch"
    with pytest.raises(DtypelabError, match=r"holds its own cache.*drop \+kv-fp8"):
        serve_policy("et-int8+kv-fp8")


def test_a_calibrated_program_gets_calibration_windows_in_generate_mode():
    from dtypelab.serving.bench import Setup
    from dtypelab.sweep import BenchOptions

    setup = Setup.of("tinylm", BenchOptions.build(None, mode="generate", policies="et-int8", prompt_len=16, gen_len=8))
    assert setup.calibration is not None and len(setup.calibration) > 0
    assert Setup.of("tinylm", BenchOptions.build(None, mode="generate", policies="et-int8-dyn")).calibration is None


@pytest.mark.e2e
def test_bench_generate_measures_a_program_beside_the_eager_model(tmp_path, monkeypatch):
    """tinylm served as a static-int8 ExecuTorch program, calibrated on text and lowered where it is measured, the same
    program timed: its quality against fp32's log-probabilities, its memory from the program, timed in the interleaved
    rounds, its delegation in the record and in a note."""
    from dtypelab.core import executorch_lm
    from dtypelab.core.results import GenerateReport
    from dtypelab.serving import serve_bench

    lowered = []
    lower = executorch_lm.lower_lm
    monkeypatch.setattr(executorch_lm, "lower_lm", lambda *a, **k: lowered.append(a[1]) or lower(*a, **k))
    path = tmp_path / "g.json"
    report = serve_bench("tinylm", prompt_len=16, gen_len=8, batch_size=2, policies="fp32,et-int8",
                         launcher="inline", rounds=2, json_path=str(path))
    assert lowered == ["int8"]  # once, where it is measured: the rounds time the very program written there
    base, program = report.policies
    assert program.status == "ok", program.reason
    assert 0 < program.quality.kl.value < 0.05 and program.quality.agreement > 0.8
    g, c = program.generate, program.conversion
    assert g.weights_bytes < base.generate.weights_bytes / 2  # int8 linear layers inside the program
    assert g.kv_cache_bytes == c["cache_bytes"] and len(g.decode_runs_s) == 2  # timed in the rounds
    assert c["batch"] == 2 and c["max_len"] == 32 and c["delegated"] >= 1  # tinylm's held-out windows: 32
    assert any("ExecuTorch .pte program" in n and "a cache of 32 positions" in n for n in program.notes)
    assert GenerateReport.from_json(path.read_text()).result("et-int8").conversion == c
