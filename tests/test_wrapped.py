"""lab.setup wraps the script's objects, never patches them: what a script does with its model and optimizer works
the same alone and under dtypelab (torch.save and loading back, pickle, deepcopy, state_dict keys, torch.compile,
submodules, hooks, LR schedulers, step(closure), several optimizers, no optimizer at all, its own autocast and
GradScaler)."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import fake_hardware
from test_script import _plain, _sent, _session
from torch import nn

import dtypelab
from dtypelab import DtypelabError
from dtypelab.core.policies import Cast, Plan, regions
from dtypelab.run.channel import Channel

HERE = os.path.dirname(__file__)
REAL = os.path.join(HERE, "scripts", "real_script.py")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    return x, (x[:, 0] > 0).long()


def _driven(tmp_path, monkeypatch, policy: str, optimizer=torch.optim.SGD, **kw):
    """A driven session (as the script launcher drives one), a fresh Net and its optimizer set up under it."""
    torch.manual_seed(0)
    model = Net()
    lab = _session(tmp_path, monkeypatch, policy)
    wrapped, opt = lab.setup(model, optimizer(model.parameters(), **({"lr": 0.1} | kw)))
    return lab, wrapped, opt, *_data()


def test_the_scripts_own_objects_are_left_exactly_as_they_were(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, x = Net(), _data()[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = (dict(vars(model)), dict(vars(opt)), type(model), type(opt))
    lab = _session(tmp_path, monkeypatch, "amp-bf16")
    wrapped, wopt = lab.setup(model, opt)
    assert (dict(vars(model)), dict(vars(opt)), type(model), type(opt)) == before  # nothing added or replaced
    assert "forward" not in vars(model) and "step" not in vars(opt)
    assert isinstance(wrapped, Net) and isinstance(wopt, torch.optim.AdamW) and wopt.param_groups is opt.param_groups
    assert list(wrapped.state_dict()) == list(model.state_dict()) == ["body.0.weight", "body.0.bias", "head.weight",
                                                                    "head.bias"]
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert wrapped.head is model.head and wrapped.body[0] is model.body[0] and repr(wrapped) == repr(model)
    # under autocast the model computes in bfloat16, its outputs come back in float32
    calls = []
    wrapped.head.register_forward_hook(lambda m, i, o: calls.append(o.dtype))
    out = wrapped(x)
    assert out.dtype == torch.float32 and calls == [torch.bfloat16]
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_save_pickle_and_deepcopy_give_the_users_own_model(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, x = Net(), _data()[0]
    lab = _session(tmp_path, monkeypatch, "fp32")
    wrapped = lab.setup(model)
    buf = io.BytesIO()
    torch.save(wrapped, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([Net, nn.Linear, nn.Sequential, nn.Tanh]):
        loaded = torch.load(buf)  # weights_only=True: nothing of dtypelab's is in the file
    assert type(loaded) is Net and torch.equal(loaded(x), model(x))
    assert type(pickle.loads(pickle.dumps(wrapped))) is Net
    assert type(wrapped) is not Net and wrapped.__class__ is type(wrapped)  # the one-shot answer was used up
    ema = copy.deepcopy(wrapped)  # timm's ModelEmaV2 copies the model so
    assert isinstance(ema, Net) and ema.head is not model.head
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
        assert float(ema(x).abs().max()) == 0.0  # it computes with its own (zeroed) weights
        assert float(wrapped(x).abs().max()) > 0.0
    again = lab.setup(loaded)  # a model loaded back is set up again to run under the policy
    assert isinstance(again, Net) and torch.equal(again(x), model(x))
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_compile_after_setup_runs_under_the_policy_and_is_timed(tmp_path, monkeypatch):
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "amp-bf16")
    compiled = torch.compile(wrapped, backend="eager")
    for _ in range(3):
        loss = nn.functional.cross_entropy(compiled(x), y)
        lab.backward(loss)
        opt.step()
        opt.zero_grad()
    assert len(lab.timer.samples) == 3 and len(lab.losses) == 3
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_a_closure_step_is_timed_around_every_closure_call(tmp_path, monkeypatch):
    """LBFGS calls its closure several times per step: one step, timed around all of them, its loss the first."""
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "fp32", torch.optim.LBFGS, lr=0.5, max_iter=5)
    seen = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()  # the script's own backward: the loss is what the closure returns
        seen.append(loss.item())
        return loss

    first = opt.step(closure)
    assert len(seen) > 1 and first.item() == seen[0]
    assert len(lab.timer.samples) == 1 and lab.losses == [pytest.approx(seen[0])]
    lab.finish(accuracy=1.0)
    assert _sent(lab).forwards == len(seen)


def test_a_closure_under_a_gradscaler_policy_is_skipped_with_the_reason(tmp_path, monkeypatch):
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "amp-fp16", torch.optim.LBFGS)
    with pytest.raises(SystemExit):
        opt.step(lambda: nn.functional.cross_entropy(wrapped(x), y))
    sent = _sent(lab)
    assert type(sent).__name__ == "ScriptSkip" and "GradScaler cannot step an optimizer with a closure" in sent.reason


def test_weights_updated_by_hand_are_timed_from_one_call_to_the_next(tmp_path, monkeypatch):
    """word_language_model's default: no optimizer, p.data.add_(p.grad, alpha=-lr). An evaluation between epochs
    ends the open step and is not part of it."""
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    lab = _session(tmp_path, monkeypatch, "fp32")
    wrapped = lab.setup(model)
    for epoch in range(2):
        wrapped.train()
        for _ in range(4):
            wrapped.zero_grad()
            lab.backward(nn.functional.cross_entropy(wrapped(x), y))
            for p in wrapped.parameters():
                p.data.add_(p.grad, alpha=-0.1)
        wrapped.eval()
        with torch.no_grad():
            wrapped(x)
        assert len(lab.timer.samples) == 4 * (epoch + 1)
    assert len(lab.losses) == 8 and lab.losses[-1] < lab.losses[0]
    lab.finish(accuracy=1.0)
    sent = _sent(lab)
    assert len(sent.step_times_s) == 8 and sent.optimizers == 0


def test_the_scripts_own_autocast_is_turned_off_inside_the_model_and_said(tmp_path, monkeypatch):
    """nanoGPT wraps its forward in its own autocast: under dtypelab each policy runs as named."""
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "fp32")
    dtypes = []
    wrapped.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(wrapped(x), y)
    lab.backward(loss)
    opt.step()
    assert dtypes == [torch.float32]  # the fp32 baseline really is fp32
    lab.finish(accuracy=1.0)
    assert _sent(lab).script_autocast == ("bfloat16 on cpu",)


def test_the_scripts_own_gradscaler_given_to_setup_becomes_the_policys(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    lab = _session(tmp_path, monkeypatch, "amp-fp16")
    own = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only when its own dtype is float16
    wrapped, opt, scaler = lab.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), own)
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    loss = nn.functional.cross_entropy(wrapped(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1e9)
    assert 0 < float(norm) < 100  # true gradients, not gradients times 65536
    scaler.step(opt)
    scaler.update()
    assert lab.losses == [pytest.approx(loss.item())] and len(lab.timer.samples) == 1
    from dtypelab.script.wrap import unwrap

    scaler.scale(nn.functional.cross_entropy(wrapped(x), y)).backward()
    scaler.step(unwrap(opt))  # the script's own optimizer object, kept under its old name: stepped all the same
    assert len(lab.timer.samples) == 2 and lab.precision.stats()["grad_scale"][-1] > 0
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_the_scripts_own_enabled_gradscaler_not_given_to_setup_is_refused_in_one_line(tmp_path, monkeypatch):
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "fp32")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(nn.functional.cross_entropy(wrapped(x), y)).backward()
    with pytest.raises(DtypelabError, match=r"its own GradScaler: pass it to lab.setup"):
        scaler.step(opt)
    lab.channel.close()


def test_run_alone_setup_hands_back_the_very_same_objects():
    code = ("import torch, dtypelab; m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=1); "
            "lab = dtypelab.session(); a, b = lab.setup(m, o); print(a is m and b is o and 'forward' not in vars(m))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTYPELAB_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.stdout.strip() == "True", run.stderr


def test_run_alone_a_session_leaves_the_scripts_garbage_and_heap_alone(monkeypatch):
    import gc

    for k in [k for k in os.environ if k.startswith("DTYPELAB_")]:
        monkeypatch.delenv(k)
    collections: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.disable()  # only a collection the session asks for is seen
    gc.callbacks.append(seen)
    try:
        lab = dtypelab.session()
        model = lab.setup(Net())
        lab.backward(model(torch.randn(4, 8)).sum())
        lab.finish(loss=1.0)
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    assert collections == []


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("--optimizer", "adamw", "--save", "{tmp}/m.pt", "--ema"),
    ("--optimizer", "lbfgs"),
    ("--optimizer", "none"),
    ("--optimizer", "two"),
    ("--dtype", "bfloat16", "--scaler-to-setup"),
], ids=["save-ema", "lbfgs", "by-hand", "two", "own-amp"])
def test_real_patterns_train_the_same_alone_and_under_bench(args, tmp_path):
    """Each pattern asserts itself inside the script; its fp32 run under bench must train exactly as the plain
    script does without dtypelab, with every step timed."""
    args = tuple(a.format(tmp=tmp_path) for a in args)
    plain = _plain(REAL, *args, "--no-lab")
    if "--save" in args:  # with the lines, run alone, setup hands back the very objects (one run shows it suffices)
        assert _plain(REAL, *args) == plain
    report = dtypelab.bench(REAL, "fp32", script_args=args, hardware=fake_hardware(), runs=1)
    fp32 = report.result("fp32")
    assert fp32.status == "ok", fp32.reason
    if "--dtype" in args:  # the script's own bf16 autocast is off under every policy: fp32 is the plain fp32 run
        plain = _plain(REAL, *args[:args.index("--dtype")], "--no-lab")
        assert not plain.startswith(_plain(REAL, *args, "--no-lab")[:17])  # its own bf16 run trains differently
    assert plain.startswith(f"val_loss {fp32.metrics['val_loss']:.6f}")
    assert len(fp32.step_times_s) == 24 and len(fp32.losses) == 24
    # the gradients, counted where the step ends: weights updated by hand zero them through the model
    assert fp32.memory["gradients"] == fp32.memory["parameters"] > 0
    if "--dtype" in args:
        assert any(n.startswith("the script's own autocast (bfloat16 on cpu) was on") for n in fp32.notes)
        assert "fp32: the script's own autocast (bfloat16 on cpu) was on around the model" in " ".join(
            report.recommendation.sentences)


def _plan_session(tmp_path, monkeypatch, plan):
    channel = Channel({"plan": plan.to_dict(), "seed": 0, "device": "cpu"})
    for key, value in channel.env.items():
        monkeypatch.setenv(key, value)
    lab = dtypelab.session()
    lab.channel = channel
    return lab


def _check_user_patterns(wrapped, model, x, region_names, outer):
    """What #39's patterns need of a model under a per-layer plan: nothing of the user's patched, keys unchanged,
    the whole model saved and loaded back as the user's classes (runnable as plain PyTorch), a deepcopy EMA that
    computes with its own weights in the same regions, compile, the user's hooks on a region's layer."""
    assert "forward" not in vars(model.body) and "forward" not in vars(model.body[0]) and "forward" not in vars(
        model.head)
    assert not any(k.startswith("_dtypelab") for m in model.modules() for k in vars(m))
    assert list(wrapped.state_dict()) == ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
    assert set(regions(model)) == region_names
    buf = io.BytesIO()
    torch.save(wrapped, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([Net, nn.Linear, nn.Sequential, nn.Tanh]):
        loaded = torch.load(buf)  # weights_only=True: the user's classes only
    assert type(loaded) is Net and type(loaded.body) is nn.Sequential and type(loaded.head) is nn.Linear
    assert {p.dtype for p in loaded.parameters()} == {outer}  # each region written in the model's dtype around it
    assert torch.allclose(loaded(x.to(outer)).float(), wrapped(x).float(), atol=0.05)
    assert type(pickle.loads(pickle.dumps(wrapped))) is Net
    ema = copy.deepcopy(wrapped)
    assert set(regions(ema)) == region_names and ema.body[0].weight is not model.body[0].weight
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
        assert float(ema(x).abs().max()) == 0.0 and float(wrapped(x).abs().max()) > 0.0
    seen = []
    handle = wrapped.body[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    compiled = torch.compile(wrapped)
    assert torch.isfinite(compiled(x)).all()
    wrapped(x)
    handle.remove()
    return seen


def test_a_per_layer_plan_leaves_the_users_submodules_unpatched(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, x = Net(), _data()[0]
    plan = Plan(Cast("float32"), (("body", Cast("bfloat16")),), name="body-bf16")
    lab = _plan_session(tmp_path, monkeypatch, plan)
    wrapped, _ = lab.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = _check_user_patterns(wrapped, model, x, {"body"}, torch.float32)
    assert seen and set(seen) == {torch.bfloat16}  # the layer ran in its region
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_an_autopilot_move_leaves_the_users_submodules_unpatched(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, x = Net(), _data()[0]
    lab = _plan_session(tmp_path, monkeypatch, dtypelab.get_policy("bf16"))
    wrapped, opt = lab.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    F.cross_entropy(wrapped(x).float(), _data()[1]).backward()
    opt.step()
    lab.precision.promote(wrapped, "head", Cast("float32"), opt)  # what the autopilot does to a layer near overflow
    assert model.head.weight.dtype == torch.float32 and opt.state[model.head.weight]["exp_avg"].dtype == torch.float32
    seen = _check_user_patterns(wrapped, model, x, {"head"}, torch.bfloat16)
    assert set(seen) == {torch.bfloat16}  # body[0] is outside the moved region
    lab.precision.promote(wrapped, "head", Cast("bfloat16"), opt)  # moved again: one region, not a wrapper in one
    assert set(regions(model)) == {"head"} and regions(model)["head"].config == Cast("bfloat16")
    lab.finish(accuracy=1.0)
    _sent(lab)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_per_layer_plan_over_a_script_that_saves_its_whole_model(tmp_path):
    """word_language_model's pattern (torch.save(model), torch.load with safe_globals, the loaded model evaluated)
    with an EMA copy, measured under a plan that gives one nn.Sequential child bfloat16."""
    plan = tmp_path / "body-bf16.json"
    plan.write_text(Plan(Cast("float32"), (("body", Cast("bfloat16")),), name="body-bf16").to_json())
    args = ("--optimizer", "adamw", "--save", f"{tmp_path}/m.pt", "--ema", "--epochs", "1")
    report = dtypelab.bench(REAL, f"fp32,{plan}", script_args=args, hardware=fake_hardware(), runs=1)
    assert [r.status for r in report.results] == ["ok", "ok"], [r.reason for r in report.results]
    assert report.result("body-bf16").metrics["val_loss"] > 0


def test_a_wrapped_model_inside_another_module_saves_and_loads_with_its_own_keys(tmp_path, monkeypatch):
    """torch's AveragedModel (an EMA) and torch.compile hold the model as a child: their state_dict and
    load_state_dict reach its weights under the same keys as without dtypelab; an attribute of the user's own
    named like a wrapper's (``.module``, as EMA helpers have) is the user's."""
    torch.manual_seed(0)
    plain = Net()
    plain.module = nn.Identity()  # the user's own attribute
    model = copy.deepcopy(plain)
    lab = _session(tmp_path, monkeypatch, "fp32")
    wrapped = lab.setup(model)
    assert isinstance(wrapped.module, nn.Identity)
    ema, ema_plain = (torch.optim.swa_utils.AveragedModel(m) for m in (wrapped, plain))
    assert list(ema.state_dict()) == list(ema_plain.state_dict())
    zeroed = {k: torch.zeros_like(v) for k, v in ema.state_dict().items()}
    ema.load_state_dict(zeroed)  # strict: every key is the wrapped model's
    assert all(p.detach().abs().sum().item() == 0 for p in ema.module.parameters())
    compiled, compiled_plain = (torch.compile(m, backend="eager") for m in (wrapped, plain))
    assert list(compiled.state_dict()) == list(compiled_plain.state_dict())
    compiled.load_state_dict(compiled_plain.state_dict())
    assert torch.equal(model.head.weight, plain.head.weight)
    lab.finish(accuracy=1.0)
    _sent(lab)


def test_a_disabled_gradscaler_of_the_scripts_own_skips_only_the_policy_that_scales(tmp_path, monkeypatch):
    """nanoGPT with --dtype=bfloat16 keeps GradScaler(enabled=False) and steps through it: harmless under every
    policy but amp-fp16, whose own scaler it would bypass; that one is skipped, saying what to change."""
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "fp32")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.scale(nn.functional.cross_entropy(wrapped(x), y)).backward()
    scaler.step(opt)  # fp32: stepped as the script asked
    assert lab.losses == [] and len(lab.timer.samples) == 1
    lab.finish(accuracy=1.0)
    _sent(lab)
    lab, wrapped, opt, x, y = _driven(tmp_path, monkeypatch, "amp-fp16")
    scaler.scale(nn.functional.cross_entropy(wrapped(x), y)).backward()
    with pytest.raises(SystemExit):
        scaler.step(opt)
    sent = _sent(lab)
    assert type(sent).__name__ == "ScriptSkip"
    assert "pass it to lab.setup (model, optimizer, scaler = lab.setup(" in sent.reason


def test_lab_step_end_ends_a_hand_updated_step_at_once(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    lab = _session(tmp_path, monkeypatch, "fp32")
    wrapped = lab.setup(model)
    lab.backward(nn.functional.cross_entropy(wrapped(x), y))
    assert lab.timer.samples == []
    lab.step_end()
    assert len(lab.timer.samples) == 1 and len(lab.losses) == 1
    with pytest.raises(DtypelabError) as bad:
        lab.setup(model, "adam")
    assert str(bad.value) == "lab.setup takes the model, its optimizers and optionally its GradScaler; got str"
    lab.finish(accuracy=1.0)
    _sent(lab)
