"""Every registered policy: dtypes under the policy, and every global it may touch restored."""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings

import pytest
import torch
from conftest import TINY, fake_hardware
from torch._inductor import config as inductor

from dtypelab.core.policies import REGISTRY, Precision, get_policy, parse_policies, policies_for
from dtypelab.core.policies.kinds.lora import FINE_TUNING
from dtypelab.core.task import load_task
from dtypelab.sweep.job import Job, run_job


def global_state() -> dict:
    return {
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
        "autocast_cpu_dtype": torch.get_autocast_dtype("cpu"),
        "autocast_cuda_dtype": torch.get_autocast_dtype("cuda"),
        "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "inference_mode": torch.is_inference_mode_enabled(),
        # torchao's configs would set inductor flags process-wide; int8-dyn-compile patches them per run
        "inductor": (inductor.force_fuse_int_mm_with_mul, inductor.coordinate_descent_tuning),
        "loggers": tuple(logging.getLogger(n).level for n in ("torchao", "torch.utils._pytree")),
        "warning_filters": len(warnings.filters),
    }


# GPU-only policies (fp8 training, fp8 dynamic, int4) are run by test_cuda.py's copy of this test
CPU_POLICIES = {n: plan for n, plan in REGISTRY.items() if not plan.gpu_only}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The fp32 reference run's folder (its weights and outputs), once: inference policies start from a copy."""
    wd = str(tmp_path_factory.mktemp("reference"))
    assert run_job(Job(f"{TINY}:make_task", "fp32", "reference", 3, 8, 1, 0, "cpu", wd)).ran
    return wd


@pytest.mark.parametrize(("name", "mode"), [(n, m) for n, plan in CPU_POLICIES.items() for m in plan.modes])
def test_every_policy_restores_globals(name, mode, tiny, request):
    before = global_state()
    with tempfile.TemporaryDirectory() as wd:
        if mode == "infer":  # inference needs the fp32 reference weights first
            shutil.copytree(request.getfixturevalue("reference"), wd, dirs_exist_ok=True)
        result = run_job(Job(tiny, name, mode, 3, 8, 1, 0, "cpu", wd, threads=1))
    assert result.ran, result.reason  # pure fp16 + Adam may diverge (eps=1e-8 is 0 in fp16): still ran
    assert global_state() == before


@pytest.mark.parametrize("name", list(REGISTRY))
def test_session_restores_globals_even_on_error(name):
    before = global_state()
    with pytest.raises(RuntimeError), Precision(get_policy(name), "cpu").session():
        raise RuntimeError("boom")
    assert global_state() == before


EXPECTED = {  # policy -> (parameter dtype, dtype of a Linear's output in forward)
    "fp64": (torch.float64, torch.float64),
    "fp32": (torch.float32, torch.float32),
    "tf32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "amp-bf16": (torch.float32, torch.bfloat16),
    "amp-fp16": (torch.float32, torch.float16),
    "fp32+compile": (torch.float32, torch.float32),
    "bf16+compile": (torch.bfloat16, torch.bfloat16),
    "amp-bf16+compile": (torch.float32, torch.bfloat16),
    "bf16-sr": (torch.bfloat16, torch.bfloat16),
    "bf16-kahan": (torch.bfloat16, torch.bfloat16),
    # emulated float8 training: float32 weights; the tiny task's first Linear (8 inputs) is not a float8 shape, so it
    # runs under autocast; mxfp8: the model in bfloat16, its 8 inputs not a multiple of MX's 32-value blocks
    **{name: (torch.float32, torch.bfloat16) for name in (
        f"fp8-{r}{s}-emu" for r in ("tensorwise", "rowwise", "rowwise-gw-hp") for s in ("", "-all"))},
    "mxfp8-emu": (torch.bfloat16, torch.bfloat16),
}
# float8 training: float32 weights; the tiny task's first Linear is too small to pay, so it runs under autocast
GPU_EXPECTED = {"fp8-tensorwise": (torch.float32, torch.bfloat16), "fp8-rowwise": (torch.float32, torch.bfloat16),
                "fp8-rowwise-gw-hp": (torch.float32, torch.bfloat16), "mxfp8": (torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("name", [n for n in policies_for("train") if n in CPU_POLICIES and n not in FINE_TUNING])
def test_module_and_activation_dtypes(name, tiny):
    # the fine-tuning policies freeze most weights in another format: tests/test_finetune.py checks them
    assert set(EXPECTED) | set(GPU_EXPECTED) | set(FINE_TUNING) == set(policies_for("train")), \
        "add the new policy to EXPECTED"
    policy = Precision(get_policy(name), "cpu")
    task = load_task(tiny)
    model = policy.convert_module(task.make_model())
    seen = []
    model.net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, y = task.train_batch(0, 4)
    with policy.session():
        x = policy.convert_input(x)
        with policy.forward_context():
            loss = task.loss_fn(model(x), y)
        policy.backward(loss)
    param_dtype, act_dtype = EXPECTED[name]
    assert {p.dtype for p in model.parameters()} == {param_dtype}
    assert seen == [act_dtype]
    assert all(p.grad is not None and p.grad.dtype == param_dtype for p in model.parameters())


def test_gradscaler_records_scale_and_skipped_steps():
    policy = Precision(get_policy("amp-fp16"), "cpu")
    model = torch.nn.Module()
    model.w, model.ok = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))
    w = policy.convert_module(model).w
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for value in (1.0, float("inf"), 1.0):  # the middle step overflows and must be skipped
        opt.zero_grad()
        with policy.forward_context():
            loss = (w * value).sum() + model.ok.sum()
        policy.backward(loss)
        policy.optimizer_step(opt)
    stats = policy.stats()
    assert stats["skipped_steps"] == 1
    assert stats["first_skipped_step"] == 1
    assert stats["grad_scale"][2] == stats["grad_scale"][1] / 2  # backed off after the overflow
    # which parameters had the non-finite gradients on the skipped step: w, not ok
    assert stats["skips"] == [{"step": 1, "scale": 65536.0, "nonfinite_params": ["w"], "n_nonfinite_params": 1}]
    assert stats["collapse_step"] is None


def test_availability_on_a_cpu_without_fp16():
    hw = fake_hardware(fp16_gflops=0.5)
    assert not get_policy("tf32").availability(hw).ok
    fp16 = get_policy("fp16").availability(hw)
    assert fp16.ok and fp16.slow and "0.5 GFLOP/s vs 100" in fp16.reason and "no native float16" in fp16.reason
    assert not get_policy("amp-bf16").availability(hw).slow
    fast = fake_hardware(fp16_gflops=300.0)
    assert not get_policy("fp16").availability(fast).slow


def test_unknown_policy_suggests_closest():
    from dtypelab import DtypelabError

    with pytest.raises(DtypelabError, match="did you mean 'amp-bf16'"):
        parse_policies("fp32,amp_bf16")
    with pytest.raises(DtypelabError, match="empty"):
        parse_policies(" , ")
    assert [p.name for p in parse_policies("fp32, bf16,fp32")] == ["fp32", "bf16"]
