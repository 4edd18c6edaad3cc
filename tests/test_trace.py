"""trace: planted NaN/Inf origins must be named exactly (op, module, pass), propagators and masks never."""

from __future__ import annotations

import json

import nan_models as nm
import pytest
import torch
from conftest import fake_hardware
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

import dtypelab
from dtypelab.core.records import load_record
from dtypelab.core.results import TraceReport
from dtypelab.core.scaler import ScalerLog, scaler_notes
from dtypelab.tracing.diagnose import explain
from dtypelab.tracing.guard import Guard, NonFiniteError
from dtypelab.tracing.snapshot import all_finite


def run(task, policy: str = "fp32", **kw) -> TraceReport:
    return dtypelab.trace(task, policy=policy, hardware=fake_hardware(), environment={}, force=True, **kw)


def test_log_of_negative_in_a_middle_layer_named_exactly_after_replay():
    r = run(nm.log_task(), checkpoint_every=5)
    f = r.finding
    assert r.status == "found" and f.reproduced
    o = f.origin
    assert (f.step, o.phase, o.op, o.module) == (7, "forward", "aten.log", "body.1.middle")
    assert o.source.endswith("nan_models.py:14") and "torch.log(x)" in o.code
    assert "log of a value below 0" in o.diagnosis and o.inputs[0].min < 0 and o.inputs[0].dtype == "float32"
    assert f.checkpoint_step == 5 and f.replayed_steps == 2  # steps 5 and 6 re-run, step 7 traced
    assert "loss" in f.reached
    # the Linear after it only propagated the NaN: it appears downstream, never as the origin
    assert f.path[0] == "aten.addmm (forward, body.2)" and not f.others


def test_fp16_exp_overflow_named_and_fine_in_fp32():
    assert run(nm.exp_task()).status == "clean"
    f = run(nm.exp_task(), "fp16").finding
    o = f.origin
    assert (o.op, o.module, o.phase) == ("aten.exp", "body.1", "forward")
    assert "> ln(65504) = 11.09 in float16" in o.diagnosis


def test_fp16_attention_scores_overflow_blames_the_matmul_not_the_softmax():
    assert run(nm.attention_task(scale=10.0)).status == "clean"
    f = run(nm.attention_task(scale=10.0), "fp16").finding
    o = f.origin
    assert (o.op, o.module) == ("aten.bmm", "attn") and "scores = q @ k" in o.code
    assert "past the float16 max 65504 (fits in float32)" in o.diagnosis
    assert any(p.startswith("aten._softmax") for p in f.path)  # the softmax turned inf into NaN: a propagator


def test_nan_created_in_backward_only():
    f = run(nm.norm_task()).finding
    o = f.origin
    assert (f.step, o.phase, o.op, o.backward_of, o.module) == (3, "backward", "aten.div", "aten.sqrt", "body.1")
    assert "torch.sqrt" in o.code and "0/0" in o.diagnosis
    assert "non-finite after the optimizer step" in f.trigger


def test_attention_mask_with_minus_inf_is_not_reported():
    r = run(nm.attention_task(scale=1.0, mask=True))
    assert r.status == "clean" and r.finding is None


def test_masks_written_with_where_full_and_sdpa_are_not_reported():
    assert run(nm.mask_styles_task(), steps=5).status == "clean"
    # ...and when something else does go wrong, the masks are still not the origin
    with pytest.raises(NonFiniteError) as info, Guard(model := nm.MaskStyles()) as guard:
        x = torch.rand(2, 6, 8)
        x[0, 0, 0] = float("nan")  # a NaN in the data: reported as such, not as a mask
        guard.step(lambda inp: model(inp).sum(), x)
    o = info.value.finding.origin
    assert o.kind == "external" and o.diagnosis == "input already non-finite: the input batch"


def test_fully_masked_row_is_reported_at_the_softmax_with_its_mask():
    f = run(nm.fully_masked_task()).finding
    o = f.origin
    assert (o.op, o.module) == ("aten._softmax", "attn")
    assert "entirely −inf" in o.diagnosis and "mask (aten.masked_fill" in o.diagnosis


def test_fp16_adam_eps_is_found_in_the_optimizer(tiny):
    f = run("digits", "fp16", steps=5).finding
    o = f.origin
    assert (f.step, o.phase, o.op) == (0, "optimizer", "aten.addcdiv_")
    assert o.tensor.endswith("(parameter)") and "eps=1e-08 rounds to 0 in float16" in o.diagnosis


def test_guard_api_in_a_users_own_loop_restores_every_global():
    task = nm.log_task()
    torch.manual_seed(0)
    model = task.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    threads, grad, dtype = torch.get_num_threads(), torch.is_grad_enabled(), torch.get_default_dtype()
    with pytest.raises(NonFiniteError) as info, dtypelab.watch(model, opt, checkpoint_every=3) as guard:
        for step in range(20):
            guard.step(train_step, *task.train_batch(step, 16))
    f = info.value.finding
    assert (f.step, f.origin.op, f.origin.module, f.checkpoint_step) == (7, "aten.log", "body.1.middle", 6)
    assert "aten.log" in str(info.value)
    assert _get_current_dispatch_mode() is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert (torch.get_num_threads(), torch.is_grad_enabled(), torch.get_default_dtype()) == (threads, grad, dtype)


def test_guard_checks_are_exact_and_leave_values_alone():
    x = torch.tensor([1e-40, -0.0, 3.0])
    before = x.clone()
    assert all_finite([x, torch.ones(2, dtype=torch.float16)])
    assert torch.equal(x, before) and torch.signbit(x[1])  # multiplying by 1.0 changed nothing
    assert not all_finite([x, torch.tensor([float("-inf")])])
    assert not all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)])
    with pytest.raises(ValueError):
        Guard(torch.nn.Linear(1, 1), checkpoint_every=0)


def test_clean_run_and_json_round_trip(tmp_path, tiny):
    path = tmp_path / "t.json"
    r = run(tiny, steps=6, json_path=str(path))
    assert r.status == "clean" and len(r.losses) == 6 and r.checkpoint_every >= 1
    assert load_record(str(path)) == r
    found = run(nm.log_task(), json_path=str(path))
    again = load_record(str(path))
    assert again.to_json() == found.to_json() and again.finding.origin.inputs[0].shape == (16, 8)


def test_diagnoses():
    def diag(fn, *args):
        out = fn(*args)
        name = fn.__name__
        flags = [(bool(t.isnan().any()), bool(t.isinf().any())) for t in args if isinstance(t, torch.Tensor)]
        return explain(name, fn, args, {}, [a for a in args if isinstance(a, torch.Tensor)], flags, [out],
                       [(bool(out.isnan().any()), bool(out.isinf().any()))], [])
    a = torch.tensor([0.0, 1.0])
    assert "0/0 → NaN" in diag(torch.div, a, torch.tensor([0.0, 0.0]))
    assert "sqrt of a negative" in diag(torch.sqrt, torch.tensor([-1.0, 4.0]))
    assert "log of zero → −inf" in diag(torch.log, a)
    assert "inf − inf" in diag(torch.sub, torch.tensor([float("inf")]), torch.tensor([float("inf")]))
    big = torch.tensor([300.0], dtype=torch.float16)
    assert "past the float16 max 65504 (fits in float32)" in diag(torch.mul, big, big)


def test_scaler_log_names_params_and_warns_on_collapse():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    log = ScalerLog(model.named_parameters())
    for step in range(24):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(2, 4)).float().sum() * 1e6  # scaled gradients overflow float16
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        log.record(step, before, scaler.get_scale())
    stats = log.stats()
    assert stats["first_skipped_step"] == 0 and stats["skipped_steps"] >= 17
    assert set(stats["skips"][0]["nonfinite_params"]) <= {"weight", "bias"} and stats["skips"][0]["n_nonfinite_params"]
    assert stats["collapse_step"] is not None and stats["min_scale"] < 1
    notes = scaler_notes(stats, 24)
    assert "skipped" in notes[0] and "collapsed below 1" in notes[1]


def test_amp_fp16_trace_logs_scaler_history(tiny):
    r = run(tiny, "amp-fp16", steps=4)
    assert r.status == "clean" and len(r.scaler["grad_scale"]) == 4 and r.scaler["skipped_steps"] == 0


@pytest.mark.slow
def test_trace_cli_exit_codes_and_show(tmp_path):
    from test_cli import dtypelab as cli

    out = tmp_path / "t.json"
    spec = f"{nm.__file__}:log_task"
    run_ = cli("trace", spec, "--json", str(out))
    assert run_.returncode == 1, run_.stderr
    for text in ("first non-finite value at step 7", "aten.log", "body.1.middle", "log of a value below 0"):
        assert text in run_.stdout
    md = cli("show", str(out), "--format", "markdown")
    assert md.returncode == 0 and "| op | aten.log |" in md.stdout
    assert json.loads(cli("show", str(out), "--format", "json").stdout)["schema"] == "dtypelab.trace"
    clean = cli("trace", f"{nm.__file__}:attention_task", "--steps", "3", "--json", str(out))
    assert clean.returncode == 0 and "no NaN/Inf in 3 steps" in clean.stdout
    bad = cli("trace", "digits", "--checkpoint-every", "0")
    assert bad.returncode == 2 and "--checkpoint-every" in bad.stderr and "Traceback" not in bad.stderr


# --- found by outside testing: the line shown, escaping, root causes --------------------------------------------
def _line(marker: str) -> int:
    import user_tasks

    with open(user_tasks.__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text)


def test_builtin_modules_name_the_model_factory_not_a_library_frame():
    import user_tasks as ut

    o = run(ut.sgd_blowup()).finding.origin
    assert (o.op, o.module) == ("aten.addmm", "2")
    assert o.source.endswith(f"user_tasks.py:{_line('# MODEL LINE')}") and "nn.Sequential" in o.code
    assert "no line of your code runs this op" in o.via and "built-in module 2 (Linear)" in o.via


def test_a_torch_loss_function_names_where_the_task_sets_it():
    import user_tasks as ut

    o = run(ut.loss_overflow(), "fp16").finding.origin
    assert o.op == "aten.mse_loss" and not o.module
    assert o.source.endswith(f"user_tasks.py:{_line('# LOSS LINE')}") and "loss_fn=F.mse_loss" in o.code
    assert "torch.nn.functional.mse_loss" in o.via


def test_a_user_forward_calling_a_builtin_module_is_named_and_said_so():
    import user_tasks as ut

    o = run(ut.via_module()).finding.origin
    assert (o.op, o.module) == ("aten.addmm", "net.0")
    assert o.source.endswith(f"user_tasks.py:{_line('# WRAPPER LINE')}")
    assert "calls into built-in module net.0 (Linear)" in o.via


def test_user_source_skips_installed_packages_and_stops_at_dtypelabs_loop(monkeypatch):
    from dtypelab.core import source

    site = source._SITE[0] if source._SITE else "/usr/lib/python3/dist-packages/"
    assert source._frame_kind(site + "typer/main.py") == "library"
    assert source._frame_kind("/x/dist-packages/click/core.py") == "library"
    assert source._frame_kind(source._PKG_DIR + "core/loop.py") == "driver"
    assert source._frame_kind(source._PKG_DIR + "core/policies/precision.py") == "library"
    assert source._frame_kind(source._PKG_DIR + "core/tasks/digits.py") == "user"
    assert source._frame_kind("/home/me/train.py") == "user"


def test_log_of_softmax_names_the_underflow_and_log_softmax():
    import user_tasks as ut

    o = run(ut.log_softmax()).finding.origin
    assert o.op == "aten.log" and "log of zero" in o.diagnosis
    assert "softmax underflows" in o.diagnosis and "torch.log_softmax" in o.diagnosis


def test_exploding_weights_point_at_the_learning_rate():
    import user_tasks as ut

    f = run(ut.sgd_blowup()).finding
    assert f.step <= 3 and len(f.weight_max) >= 2 and f.weight_max[-1][1] > 1e6 * f.weight_max[0][1]
    assert "the weights grew" in f.origin.diagnosis and "lr=1e+06" in f.origin.diagnosis


def test_root_hints_for_idioms_the_lint_rules_know():
    from dtypelab.tracing.diagnose import path_hint, root_hint
    from dtypelab.tracing.nonfinite import _Made

    assert "log_softmax" in root_hint("log", [_Made("_softmax", False, ())])
    assert "logsigmoid" in root_hint("log", [_Made("sigmoid", False, ())])
    assert "log1p" in root_hint("log", [_Made("add", True, ("mm",))])
    assert "logsumexp" in root_hint("log", [_Made("add", True, ("exp",))])
    assert "expm1" in root_hint("log", [_Made("sub", True, ("exp",))])
    assert root_hint("log", [_Made("add", False, ("mm",))]) == "" and root_hint("exp", []) == ""
    assert "torch.softmax" in path_hint("aten.exp", ("aten.sum (forward)", "aten.div (forward, attn)"))
    assert "logsumexp" in path_hint("aten.exp", ("aten.sum (forward)", "aten.log (forward)"))
    assert path_hint("aten.exp", ("aten.mul (forward)",)) == "" and path_hint("aten.mm", ("aten.div",)) == ""


def test_naive_softmax_overflow_end_to_end():
    class Naive(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = torch.exp(self.lin(x) * 1e3)
            return e / e.sum(-1, keepdim=True)

    o = run(nm.task("naive", Naive)).finding.origin
    assert o.op == "aten.exp" and "torch.softmax" in o.diagnosis


def test_trace_cli_keeps_brackets_in_code_and_names_user_lines(tmp_path):
    import user_tasks as ut
    from test_cli import dtypelab as cli

    out = tmp_path / "t.json"
    r = cli("trace", f"{ut.__file__}:brackets", "--json", str(out))
    assert r.returncode == 1, r.stderr
    assert "torch.cat([x, torch.log(x)], dim=-1)" in r.stdout and "site-packages" not in r.stdout
    assert "torch.cat([x, torch.log(x)], dim=-1)" in cli("show", str(out)).stdout
    r = cli("trace", f"{ut.__file__}:sgd_blowup")
    assert f"user_tasks.py:{_line('# MODEL LINE')}" in r.stdout and "typer" not in r.stdout
