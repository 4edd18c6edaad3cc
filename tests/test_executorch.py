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
    from dtypelab.serving import serve_policy
    from dtypelab.tuning.run import _candidate_error

    with pytest.raises(DtypelabError, match=r"whole-model ExecuTorch program.*not built yet"):
        serve_policy("et-int8")
    assert "not a config for layers" in (_candidate_error(get_policy("et-int8-dyn"), "infer") or "")
    task = load_task(f"{TINY}:make_task")
    with pytest.raises(DtypelabError, match="a device's latency is not forecast"):
        choose_policies("fp32,et-int8", task, 1)
    assert not any(p.program for p in choose_policies("all", task, 1))  # "all" leaves them out
