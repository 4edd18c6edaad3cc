"""The range audit flags planted hazards, handles awkward models, and keeps its records."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import HERE, fake_hardware

import dtypelab
from dtypelab.core.errors import DtypelabError
from dtypelab.core.records import load_record
from dtypelab.core.results import AuditReport
from dtypelab.numerics.auditing import audit

AUDIT_TASK = os.path.join(HERE, "tiny_task.py") + ":make_audit_task"
ENV = {"test": True}  # skip the hardware probe


def layer(report: AuditReport, name: str, kind: str):
    return next(x for x in report.layers if x.name == name and x.kind == kind)


@pytest.fixture(scope="module")
def report() -> AuditReport:
    return audit(AUDIT_TASK, steps=4, environment=ENV)


def test_planted_overflow_is_flagged_for_fp16_not_bf16(report):
    boom = layer(report, "boom", "activation")
    assert boom.verdicts["float16"].text.startswith("overflow risk")
    assert boom.verdicts["bfloat16"].risk.value == "safe"
    assert boom.stats["max_abs"] > 65504 and boom.severity == 3
    assert report.layers[0].severity == 3  # sorted by risk: the worst first
    assert not layer(report, "unboom", "activation").verdicts["float16"].text.startswith("overflow")


def test_planted_gradient_underflow_needs_loss_scaling_in_fp16_only(report):
    early = layer(report, "early", "grad")
    assert early.verdicts["float16"].text.startswith("gradient underflow: needs loss scaling")
    assert early.verdicts["bfloat16"].risk.value == "safe"
    weight = layer(report, "early.weight", "param_grad")
    assert weight.verdicts["float16"].text.startswith("gradient underflow: needs loss scaling")
    head = layer(report, "head", "grad")  # downstream of the shrink: ordinary gradients
    assert head.stats["max_abs"] > 1e-4
    ls = report.loss_scale
    assert ls["scale"] == 2.0 ** ls["log2_scale"] and ls["max_grad"] * ls["scale"] <= 65504 / 2
    assert ls["flushed_unscaled"] > 0.1  # the shrunk gradients are lost without scaling


def test_structured_outputs_shared_modules_and_integer_tensors(report):
    names = {(x.name, x.kind) for x in report.layers}
    assert ("pair[0]", "activation") in names and ("pair[1]", "activation") not in names  # argmax skipped
    assert ("named['hidden']", "activation") in names and ("named['index']", "activation") not in names
    assert layer(report, "shared", "activation").calls == 2 * 4  # two calls per step, four steps
    assert layer(report, "(model)", "activation").calls == 4


def test_json_round_trip_and_show(report, tmp_path):
    path = tmp_path / "audit.json"
    report.save(str(path))
    assert load_record(str(path)) == report
    assert json.loads(path.read_text())["schema"] == "dtypelab.audit"


def test_every_and_layers_filter():
    r = audit(AUDIT_TASK, steps=6, every=3, layers=r"^(boom|early)", environment=ENV)
    assert {x.name for x in r.layers} <= {"boom", "early", "early.weight", "early.bias"}
    assert layer(r, "boom", "activation").calls == 2  # steps 0 and 3
    assert len(r.losses) == 6


def test_policy_and_globals_are_restored():
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
              torch.get_num_threads())
    r = audit(AUDIT_TASK, policy="amp-bf16", steps=2, threads=1, environment=ENV, hardware=fake_hardware())
    assert r.config.policy == "amp-bf16" and r.status == "ok"
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_num_threads()) == before


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"steps": 0}, "at least 1"),
    ({"layers": "(["}, "not a valid regular expression"),
    ({"formats": "int8"}, "no subnormal range"),
    ({"formats": "fp17"}, "did you mean"),
    ({"policy": "bf61"}, "unknown policy"),
])
def test_bad_input_is_a_clear_error(kwargs, message):
    with pytest.raises(DtypelabError, match=message):
        audit(AUDIT_TASK, environment=ENV, **kwargs)


def test_slow_policies_are_refused_unless_forced(hw):
    with pytest.raises(DtypelabError, match="--force runs it anyway"):
        audit(AUDIT_TASK, policy="amp-fp16", steps=1, environment=ENV, hardware=hw)
    with pytest.raises(DtypelabError, match="cannot run here"):
        audit(AUDIT_TASK, policy="tf32", steps=1, environment=ENV, hardware=hw)
    r = audit(AUDIT_TASK, policy="fp16", steps=1, environment=ENV, hardware=hw, force=True)
    assert r.config.policy == "fp16" and r.layers


def test_a_failing_model_keeps_what_was_measured(tmp_path, tiny):
    r = audit(tiny.replace("make_task", "make_raising_task"), policy="bf16", steps=3, environment=ENV,
              json_path=str(tmp_path / "a.json"), hardware=fake_hardware())
    assert r.status == "failed" and "planted failure" in r.reason
    assert load_record(str(tmp_path / "a.json")).status == "failed"


class _Into(torch.nn.Module):
    """A Linear whose output lands in memory shared with another layer's, as the allocator's reuse of a freed
    block does: a fresh tensor on the same storage has the same address, dtype, size and version."""

    def __init__(self, storage: torch.UntypedStorage, scale: float) -> None:
        super().__init__()
        self.lin, self.storage = torch.nn.Linear(64, 64), storage
        with torch.no_grad():
            self.lin.weight.mul_(scale)

    def forward(self, x):
        y = self.lin(x)
        return torch.empty(0).set_(self.storage, 0, y.shape).copy_(y)


class _Reuse(torch.nn.Module):
    """Two layers with equal-sized outputs, the first dead before the second is made, magnitudes ~1000x apart."""

    def __init__(self) -> None:
        super().__init__()
        storage = torch.empty(32 * 64).untyped_storage()
        self.small, self.big = _Into(storage, 1.0), _Into(storage, 1000.0)
        self.ptrs: list[int] = []

    def forward(self, x):
        a = self.small(x)
        self.ptrs.append(a.data_ptr())
        s = a.sum(dim=1, keepdim=True).clone()  # keeps no reference to `a`, which dies here
        del a
        b = self.big(x)
        self.ptrs.append(b.data_ptr())
        return b.clone() + s


def test_a_freed_tensors_address_is_not_its_identity():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    models: list[_Reuse] = []

    def make_model() -> _Reuse:
        models.append(_Reuse())
        return models[-1]

    task = dtypelab.Task(name="reuse", make_model=make_model, train_batch=lambda step, bs: (x, torch.zeros(32, 64)),
                         loss_fn=torch.nn.functional.mse_loss, evaluate=lambda predict: {"m": 0.0}, metric="m",
                         higher_is_better=True, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.0), steps=2,
                         batch_size=32)
    r = audit(task, steps=2, environment=ENV, hardware=fake_hardware())
    ptrs = models[-1].ptrs
    assert ptrs[0] == ptrs[1], "the two outputs must share an address, or the test proves nothing"
    rows = {(x.name, x.kind): x.stats for x in r.layers}
    small, big = rows[("small", "activation")]["max_abs"], rows[("big", "activation")]["max_abs"]
    with torch.no_grad():
        true_big = models[-1].big.lin(x).abs().max().item()
    assert big == pytest.approx(true_big, rel=1e-6) and big > 100 * small, (small, big, true_big)
