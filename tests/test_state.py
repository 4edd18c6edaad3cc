"""The precision of the training state: bf16 weights that keep their updates (bf16-sr, bf16-kahan), Adam's state in
8 / 4 bits (+adam8bit, +adam4bit), where the memory goes (exact bytes), and which updates round away (the audit's
count checked against a brute-force one made with ml_dtypes' rounding)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import HERE, avx2_hardware, fake_hardware
from torch import nn

import dtypelab
from dtypelab import DtypelabError
from dtypelab.core.errors import Unsupported
from dtypelab.core.footprint import state_memory, tensor_bytes
from dtypelab.core.policies import Plan, Precision, get_policy, plan_from_dict
from dtypelab.core.policies.kinds import BF16Update, LowBitState
from dtypelab.core.task import load_task
from dtypelab.core.updates import UpdateCounter

ROOT = os.path.dirname(HERE)
LOST = f"{os.path.join(ROOT, 'examples', 'lost_updates.py')}:make_task"
ADAM_SCRIPT = os.path.join(HERE, "scripts", "adam_script.py")
SCHED_SCRIPT = os.path.join(HERE, "scripts", "sched_script.py")


def _convert(policy: str, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    return Precision(get_policy(policy), "cpu").convert_optimizer(optimizer, model)


# --- names, plans, refusals ---------------------------------------------------------------------------
def test_state_policies_are_registered_names_and_modifiers_of_any_policy():
    assert get_policy("bf16-sr").default == BF16Update("stochastic-round")
    assert get_policy("bf16-kahan").default == BF16Update("kahan")
    plan = get_policy("amp-bf16+adam8bit")
    assert plan.name == "amp-bf16+adam8bit" and plan.state == LowBitState("8bit") and plan.modes == ("train",)
    assert plan_from_dict(plan.to_dict()) == plan
    assert get_policy("bf16-sr+adam4bit+ddp").name == "bf16-sr+adam4bit+ddp"
    # a plan file says the same with "state"
    assert Plan.from_dict({"default": {"kind": "cast"}, "state": {"kind": "optimizer-state", "bits": "4bit"}}
                          ).state == LowBitState("4bit")
    assert plan_from_dict({"default": "fp32", "state": "adam8bit"}).name == "fp32+adam8bit"
    # per layer: a plan's rule may give one module bf16-sr
    mixed = plan_from_dict({"default": "fp32", "rules": {"2": "bf16-sr"}})
    precision = Precision(mixed, "cpu")
    model = precision.convert_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 2 + [torch.bfloat16] * 2
    opt = precision.convert_optimizer(torch.optim.AdamW(model.parameters()), model)
    assert type(opt).__name__ == "_AdamW" and opt.bf16_stochastic_round  # applied to the bfloat16 layer alone
    with pytest.raises(DtypelabError, match="do not combine"):
        get_policy("bf16-kahan+adam8bit")
    with pytest.raises(DtypelabError, match="unknown policy 'adam8bit'"):
        get_policy("adam8bit")


def test_float8_state_needs_a_recent_gpu_and_says_so():
    avail = get_policy("fp32+adamfp8").availability(fake_hardware())
    assert not avail.ok and "compute capability >= 8.9" in avail.reason and "CPU" in avail.reason


def test_optimizers_without_a_variant_are_skipped_with_the_reason():
    model = nn.Linear(4, 2)
    with pytest.raises(Unsupported, match="no low-bit variant of SGD"):
        _convert("fp32+adam8bit", torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(Unsupported, match="no stochastic-rounding variant of LBFGS"):
        _convert("bf16-sr", torch.optim.LBFGS(model.parameters()), model)
    with pytest.raises(Unsupported, match="no Kahan-summation variant of Adagrad"):
        _convert("bf16-kahan", torch.optim.Adagrad(model.parameters()), model)
    with pytest.raises(Unsupported, match="torch-optimi's Adam has no amsgrad"):
        _convert("bf16-kahan", torch.optim.Adam(model.parameters(), amsgrad=True), model)
    with pytest.raises(Unsupported, match="couples it"):  # Adam's L2 weight decay is not torchao's AdamW
        _convert("bf16-sr", torch.optim.Adam(model.parameters(), weight_decay=0.1), model)


@pytest.mark.parametrize(("policy", "cls"), [("fp32+adam8bit", "AdamW8bit"), ("fp32+adam4bit", "AdamW4bit"),
                                              ("bf16-sr", "_AdamW"), ("bf16-kahan", "AdamW")])
def test_the_replacement_keeps_hyperparameters_groups_and_the_scheduler(policy, cls):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    old = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 2e-3},
                             {"params": model[1].parameters(), "lr": 1e-3, "weight_decay": 0.0}],
                            betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)  # made on the script's optimizer
    new = _convert(policy, old, model)
    assert type(new).__name__ == cls
    assert [g["params"] for g in new.param_groups] == [g["params"] for g in old.param_groups]
    for group, lr, wd in zip(new.param_groups, (2e-3, 1e-3), (0.05, 0.0), strict=True):
        assert float(group["lr"]) == pytest.approx(lr) and group["weight_decay"] == wd
        assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-7
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # torch's warning: no step was taken here
        scheduler.step()  # the scheduler still reaches the groups the new optimizer steps
    assert float(new.param_groups[0]["lr"]) == pytest.approx(1e-3)


def test_a_number_assigned_to_lr_each_step_is_taken_by_torchaos_tensor_lr():
    model = nn.Linear(64, 64)
    precision = Precision(get_policy("fp32+adam8bit"), "cpu")
    opt = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    for lr in (1e-2, 0.0):  # as nanoGPT's schedule does
        for group in opt.param_groups:
            group["lr"] = lr
        before = model.weight.detach().clone()
        model(torch.randn(4, 64)).square().mean().backward()
        precision.step(opt)
        assert torch.equal(model.weight, before) == (lr == 0.0)


# --- exact bytes ------------------------------------------------------------------------------------
def _trained_state(policy: str) -> dict:
    torch.manual_seed(0)
    precision = Precision(get_policy(policy), "cpu")
    model = precision.convert_module(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256, bias=False)))
    opt = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    with precision.session():
        for _ in range(2):
            opt.zero_grad()
            with precision.forward_context():
                loss = model(precision.convert_input(torch.randn(8, 256))).float().square().mean()
            precision.backward(loss)
            precision.optimizer_step(opt)
    storages = {}  # an independent count: every distinct storage the optimizer state holds, whole
    for state in opt.state.values():
        for value in state.values():
            inner = [getattr(value, n) for n in value.__tensor_flatten__()[0]] \
                if hasattr(value, "__tensor_flatten__") else [value]
            for t in inner:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for group in opt.param_groups:  # torchao's Adam keeps each group's lr as a tensor: state too
        for value in group.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return {"memory": state_memory(model, [opt], precision.master_tensors(opt)), "storages": sum(storages.values())}


def test_memory_is_counted_exactly_from_the_tensors():
    fp32, bf16 = _trained_state("fp32"), _trained_state("bf16")
    n = 256 * 256 * 2 + 256
    assert fp32["memory"]["parameters"] == 4 * n and fp32["memory"]["gradients"] == 4 * n
    # Adam: two float32 moments per weight and a float32 step counter per tensor
    assert fp32["memory"]["optimizer_state"] == 8 * n + 4 * 3 == fp32["storages"]
    assert bf16["memory"]["parameters"] * 2 == fp32["memory"]["parameters"]  # exactly half
    for policy, most in (("fp32+adam8bit", 0.3), ("fp32+adam4bit", 0.2)):
        low = _trained_state(policy)
        assert low["memory"]["optimizer_state"] == low["storages"]  # the subclass by its inner tensors
        assert low["memory"]["optimizer_state"] <= most * fp32["memory"]["optimizer_state"], policy
    kahan = _trained_state("bf16-kahan")
    assert kahan["memory"]["master_weights"] == 2 * n  # a bfloat16 compensation per weight, not optimizer state
    assert kahan["memory"]["parameters"] == 2 * n


def test_tensor_bytes_counts_shared_storage_once_and_the_viewed_part_only():
    big = torch.zeros(1000)
    assert tensor_bytes([big, big[:10]]) == 4000
    assert tensor_bytes([big[:10]]) == 40  # a batch sliced from a dataset is not the dataset


# --- lost updates -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_updates_below_half_a_bf16_spacing_stall_pure_bf16_and_survive_the_state_policies():
    report = dtypelab.bench(LOST, "fp32,amp-bf16,bf16,bf16-sr,bf16-kahan", rounds=0, hardware=fake_hardware())
    fit = {r.policy: r.metric("fit") for r in report.results}
    assert fit["fp32"] > 0.99 and fit["amp-bf16"] > 0.98
    assert abs(fit["bf16"]) < 0.02  # every update rounded away: the weights never left their start
    assert fit["bf16-kahan"] > 0.98 and fit["bf16-sr"] > 0.9
    bf16 = report.result("bf16")
    assert [(u["parameter"], u["lost"]) for u in bf16.updates] == [("weight", {"bfloat16": 1.0})]
    assert not report.result("bf16-sr").updates and not report.result("fp32").updates
    note = next(n for n in report.recommendation.notes if n.startswith("bf16:"))
    assert "weight 100%" in note and "amp-bf16, bf16-sr, bf16-kahan" in note
    assert report.recommendation.verdicts["bf16"].startswith("outside")


def _brute_force(task_spec: str, steps: int, every: int, fmt: type) -> dict[str, tuple[int, int]]:
    """The same training, element by element: (moved, lost when stored in ``fmt``) per parameter, with ml_dtypes
    rounding each float64 sum once."""
    task = load_task(task_spec)
    torch.manual_seed(0)
    model = task.make_model()
    opt = task.make_optimizer(model.parameters())
    out: dict[str, list[int]] = {n: [0, 0] for n, _ in model.named_parameters()}
    for step in range(steps):
        x, y = task.batch(step, task.batch_size)
        opt.zero_grad(set_to_none=True)
        task.loss_fn(model(x), y).backward()
        before = {n: (p.detach().double().numpy().copy(), p.grad.numpy() != 0) for n, p in model.named_parameters()}
        opt.step()
        if step % every:
            continue
        for n, p in model.named_parameters():
            old, pushed = before[n]
            update = p.detach().double().numpy() - old
            stored = old.astype(fmt)
            moved = pushed | (update != 0)
            same = (stored.astype(np.float64) + update).astype(fmt) == stored
            out[n][0] += int(moved.sum())
            out[n][1] += int((same & moved).sum())
    return {n: (m, lost) for n, (m, lost) in out.items()}


@pytest.mark.parametrize("task", [LOST, "digits"])
def test_the_audit_counts_lost_updates_exactly_as_a_brute_force_count(task):
    report = dtypelab.audit(task, steps=6, every=2, updates=True, hardware=fake_hardware())
    rows = {u["parameter"]: u for u in report.updates}
    truth = _brute_force(task, 6, 2, ml_dtypes.bfloat16)
    assert set(rows) == set(truth)
    for name, (moved, lost) in truth.items():
        assert rows[name]["moved"] == moved and rows[name]["steps"] == 3
        assert rows[name]["lost"]["bfloat16"] == pytest.approx(lost / moved if moved else 0.0, abs=0)
        assert rows[name]["lost"]["float32"] == 0.0  # the run's own format kept every update it made
    if task == LOST:
        assert rows["weight"]["lost"]["bfloat16"] == 1.0 and rows["weight"]["lost"]["float16"] == 0.0
        assert rows["weight"]["ratio"] == pytest.approx(6.7e-4, rel=0.2)  # Adam: ~lr / |w|


def test_a_step_the_gradscaler_skipped_is_not_counted():
    model = nn.Linear(4, 4)
    counter = UpdateCounter(model.named_parameters())
    model(torch.ones(1, 4)).sum().backward()
    counter.before()
    counter.after(skipped=True)
    assert all(r["steps"] == 0 and r["moved"] == 0 for r in counter.rows())


# --- scripts ---------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_trains_under_the_state_policies_and_an_sgd_one_is_told_why_not():
    report = dtypelab.bench(ADAM_SCRIPT, "fp32,bf16-sr,bf16-kahan,amp-bf16+adam8bit", runs=1,
                            script_args=("--scheduler",), hardware=fake_hardware())
    assert all(r.status == "ok" for r in report.results), [(r.policy, r.reason) for r in report.results]
    assert all(r.metric("lr") == pytest.approx(0.000375) for r in report.results)  # its scheduler drove them all
    fp32, low = report.result("fp32").memory, report.result("amp-bf16+adam8bit").memory
    assert fp32["gradients"] == fp32["parameters"] > 0 and fp32["activations"] > 0
    assert low["optimizer_state"] < 0.35 * fp32["optimizer_state"]
    assert report.result("bf16-kahan").memory["master_weights"] == fp32["parameters"] // 2
    sgd = dtypelab.bench(SCHED_SCRIPT, "fp32,bf16-sr", runs=1, hardware=fake_hardware())
    skipped = sgd.result("bf16-sr")
    assert skipped.status == "skipped" and skipped.skip == "inapplicable"
    assert "no stochastic-rounding variant of SGD" in skipped.reason
    assert sgd.recommendation.verdicts["bf16-sr"] == "does not apply"


# --- --memory-budget ------------------------------------------------------------------------------------
MB = 2**20


def _judged(budget_mb: float, *rows: tuple[str, float, float, float]):
    """(policy, step ms, accuracy, training memory MB) rows, judged with a memory budget."""
    from dataclasses import replace

    from test_recommend import report, result

    results = [replace(result(name, ms, acc), memory={"total": int(mb * MB)}) for name, ms, acc, mb in rows]
    plain = report(*results)
    from dtypelab.core.judging import judged

    return judged(replace(plain, config=replace(plain.config, memory_budget_bytes=int(budget_mb * MB)),
                          recommendation=None)).recommendation


def test_the_fastest_policy_within_tolerance_that_fits_is_chosen():
    rec = _judged(60, ("fp32", 10, 0.9, 100), ("bf16", 3, 0.9, 90), ("amp-bf16", 5, 0.9, 50))
    assert rec.best == "amp-bf16" and rec.verdicts["bf16"] == "needs 90 MiB > 60 MiB budget"
    assert any(s.startswith("bf16: 3.33x faster than fp32") and s.endswith("but it needs 90 MiB > 60 MiB budget.")
               for s in rec.sentences)
    # fp32 itself does not fit: the fastest that does, even though it is slower than fp32
    rec = _judged(80, ("fp32", 10, 0.9, 100), ("bf16-kahan", 12, 0.9, 60), ("bf16", 11, 0.5, 50))
    assert rec.best == "bf16-kahan" and rec.decision.value == "use"
    assert rec.sentences[0] == ("Use bf16-kahan: fp32 needs 100 MiB > 80 MiB budget, and bf16-kahan is the fastest "
                                "policy within 1% on acc that fits (60 MiB; 1.20x slower than fp32 (0.83x its "
                                "speed)).")
    # nothing within the tolerance fits: an answer, with the least memory that keeps the metric
    rec = _judged(40, ("fp32", 10, 0.9, 100), ("bf16-kahan", 12, 0.9, 60), ("bf16", 11, 0.5, 30))
    assert rec.best is None and rec.decision.value == "nothing-fits"
    assert rec.sentences[0] == ("No recommendation: nothing within 1% on acc fits the 40 MiB memory budget (fp32 "
                                "needs 100 MiB > 40 MiB budget; the least within tolerance: bf16-kahan at "
                                "60 MiB).")


def test_a_count_that_fails_loses_neither_the_measurement_nor_the_run(tiny, monkeypatch, tmp_path):
    from dtypelab.sweep import job as job_module
    from dtypelab.sweep import measures

    def broken(*_):
        raise RuntimeError("no storage")

    monkeypatch.setattr(measures, "state_after", broken)
    result = job_module.run_job(job_module.Job(tiny, "bf16", "train", 3, 8, 1, 0, "cpu", str(tmp_path)))
    assert result.status == "ok" and result.metrics and result.memory is None
    assert len(result.notes) == 1
    assert result.notes[0].startswith("the memory breakdown could not be counted (RuntimeError: no storage")


def test_activations_are_the_peak_of_one_forward_not_the_sum_over_accumulated_micro_batches():
    from dtypelab.core.footprint import saved_activations

    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(64, 32)
    with saved_activations(model) as one:
        loss = model(x).sum()
    del loss
    with saved_activations(model) as four:
        for _ in range(4):  # gradient accumulation: each micro-batch's graph is freed by its backward
            model(x).sum().backward()
    # Linear saves its input; ReLU its output; the second Linear its input, the same storage as ReLU's output: once
    assert one["bytes"] == 64 * 32 * 4 + 64 * 256 * 4 == four["bytes"]


def test_frameworks_run_an_optimizer_state_modifier_through_the_hooks_or_refuse_it():
    lightning = pytest.importorskip("dtypelab.lightning")
    assert lightning.lightning_precision(get_policy("amp-bf16")) == "bf16-mixed"
    # Lightning's own bf16-mixed would drop the 8-bit state: dtypelab's precision plugin converts the optimizer
    assert lightning.lightning_precision(get_policy("amp-bf16+adam8bit")) is None
    hf = pytest.importorskip("dtypelab.hf")
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir="/tmp/dtypelab-test-hf", report_to=[], use_cpu=True)
    # the Trainer's own torchao AdamW in 8 bits; no Trainer optimizer keeps its state in float8
    assert str(hf.training_arguments(get_policy("fp32+adam8bit"), args)[0].optim.value) == "adamw_torch_8bit"
    with pytest.raises(DtypelabError, match="the Trainer has no optim for adamfp8"):
        hf.training_arguments(get_policy("amp-bf16+adamfp8"), args)


def test_on_an_avx2_cpu_the_bf16_state_policies_are_slow_and_the_audit_counts_all_the_same():
    hw = avx2_hardware()
    for name in ("bf16-sr", "bf16-kahan", "bf16-sr+adam8bit"):
        avail = get_policy(name).availability(hw)
        assert avail.ok and avail.slow and "bfloat16" in avail.reason, name  # skipped unless --force
    assert not get_policy("fp32+adam8bit").availability(hw).slow  # float32 arithmetic: runs anywhere
    # the audit's count does not depend on the machine's speed: the same numbers as on the fast CPU
    fast = dtypelab.audit(LOST, steps=4, every=2, updates=True, hardware=fake_hardware())
    slow = dtypelab.audit(LOST, steps=4, every=2, updates=True, hardware=hw)
    assert fast.updates == slow.updates and fast.updates[0]["lost"]["bfloat16"] == 1.0


def test_a_kinds_own_memory_part_reaches_the_record_and_the_table_with_no_other_change(tiny):
    """A memory part is labelled data: a kind that counts what its first Linear keeps for the backward says so in
    ``activation_parts`` alone, and the breakdown, the record (through JSON) and bench's table carry it as it came."""
    from dataclasses import dataclass

    from dtypelab.core.footprint import ActivationPart
    from dtypelab.core.judging import judged
    from dtypelab.core.loop import build_trainable, state_after
    from dtypelab.core.policies import Cast, single
    from dtypelab.core.results import PolicyResult, Report, RunConfig
    from dtypelab.render.bench import render

    @dataclass(frozen=True)
    class FirstSaves(Cast):
        def activation_parts(self, model: nn.Module) -> list[ActivationPart]:
            first = next(m for m in model.modules() if isinstance(m, nn.Linear))
            return [ActivationPart("first layer's saves", "what the first Linear keeps for its backward", (first,))]

    task, device = load_task(tiny), torch.device("cpu")
    memories = {}
    for name, config in (("fp32", Cast("float32")), ("mine", FirstSaves("float32"))):
        precision = Precision(single(config, name=name), "cpu")
        model, optimizer = build_trainable(task, precision, device)
        memories[name] = state_after(task, model, precision, optimizer, device, 8, 0)
    assert "parts" not in memories["fp32"]
    (part,) = memories["mine"]["parts"]
    first = next(m for m in task.make_model().modules() if isinstance(m, nn.Linear))
    assert part["label"] == "first layer's saves" and part["bytes"] == 8 * first.in_features * 4  # its float32 input
    assert 0 < part["bytes"] < memories["mine"]["activations"] == memories["fp32"]["activations"]
    cfg = RunConfig("t", "train", ("fp32", "mine"), 4, 8, 1, 0, "1%", "cpu", False, 60, "acc", True)
    report = Report(cfg, {}, tuple(PolicyResult(n, "ok", step_times_s=(0.01,) * 3, memory=m)
                                   for n, m in memories.items()))
    report = judged(Report.from_dict(report.to_dict()))  # as a file holds it, judged as it is loaded
    text = render(report, "markdown")
    assert "first layer's saves: what the first Linear keeps for its backward." in text  # its note
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "first layer's saves" in line and line.startswith("|"))
    column = [c.strip() for c in lines[header].split("|")].index("first layer's saves")
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.split("|")] for line in lines[header + 2:])
            if len(cells) > column}
    assert rows["mine"][column] == f"{part['bytes'] / 1024:.2f}" and rows["fp32"][column] == "—"
