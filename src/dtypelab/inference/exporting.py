"""Write a task's model converted by a policy to a file, and load such a file back.

The file is safetensors (quantized torchao weights flattened to their int8/fp8 data and scales, with
torchao's metadata to rebuild them), or torch.save for torch.ao's packed modules, which safetensors
cannot hold. Its ``dtypelab`` metadata names the task and policy, so loading rebuilds the module tree
from the task's factory and the policy's conversion, then assigns the stored tensors.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.backends import torchao_module
from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.errors import DtypelabError
from dtypelab.core.executorch import Lowered, PteModule, missing
from dtypelab.core.executorch_lm import program_module
from dtypelab.core.loop import build_model, build_trainable, fit, forward
from dtypelab.core.machine.hardware import probe
from dtypelab.core.policies import BASELINE, Plan, Precision, get_policy
from dtypelab.core.results.store import save_bytes
from dtypelab.core.task import BUILTIN, Task, load_task
from dtypelab.core.version import __version__
from dtypelab.inference.fidelity import flat
from dtypelab.inference.sizes import PTE, SAFETENSORS, TORCH, dedupe_state, linear_weight_bytes, serialize

EXTENSIONS = {SAFETENSORS: (".safetensors",), TORCH: (".pt", ".pth"), PTE: (".pte",)}
SIDECAR = ".json"  # beside a .pte (a program a device loads as it is): dtypelab's metadata, as model.pte.json


@dataclass(frozen=True)
class ExportInfo:
    path: str
    task: str
    policy: str
    format: str
    file_bytes: int
    fp32_file_bytes: int
    linear_weight_bytes: int
    fp32_linear_weight_bytes: int
    roundtrip_max_abs_diff: float  # reloaded file vs the converted model in memory, same inputs
    weights: str  # where the fp32 weights came from
    planned_bytes: int | None = None  # a .pte: the activations' arena ExecuTorch's memory planning gives it
    # a language model's .pte (a generation program): the sequences and positions its cache holds, and its bytes
    cache: tuple[int, int, int] | None = None


def _eager(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile'd: the module that owns the weights


def _fp32_model(task: Task, spec: str, weights: str | None, seed: int) -> tuple[nn.Module, str]:
    """The fp32 model to convert: pretrained as shipped, the user's weights, or trained here."""
    torch.manual_seed(seed)
    model = task.make_model()
    if weights:
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, ValueError) as exc:
            raise DtypelabError(f"cannot load weights from {weights}: {str(exc).splitlines()[0]}") from None
        return model, weights
    if task.pretrained:
        return model, "pretrained"
    # The same training as bench's fp32 reference for inference: same seed, same batches, same weights.
    precision = Precision(get_policy(BASELINE), "cpu")
    model, optimizer = build_trainable(task, precision, torch.device("cpu"), model=build_model(task, seed))
    run = fit(task, model, precision, optimizer, torch.device("cpu"), task.steps, task.batch_size, seed)
    if run.first_nonfinite is not None:
        raise DtypelabError(f"training the fp32 model to export failed: loss non-finite from step "
                            f"{run.first_nonfinite}")
    return model, f"trained here in fp32 ({task.steps} steps, seed {seed})"


def _outputs(model: nn.Module, policy: Precision, inputs: Any) -> torch.Tensor:
    with torch.no_grad(), policy.session():
        return flat(forward(model, policy, inputs))


def export(task: str, policy: str | Plan, path: str, *, weights: str | None = None, seed: int = 0) -> ExportInfo:
    """Convert ``task``'s model with ``policy`` (a name, a plan file or a plan), write it to ``path`` and check
    that it loads back to the same outputs. A non-pretrained task is trained in fp32 first unless ``weights``
    (a state dict) is given. The file's metadata holds the plan itself, so it loads without the registry."""
    plan = get_policy(policy)
    policy = plan.name
    pol = Precision(plan, "cpu")
    # Only whether it can run here: writing a format costs no arithmetic, so a policy too slow to
    # benchmark here (fp16 on this kind of CPU) can still be exported.
    avail = plan.availability(probe("cpu", budget_s=0.02))
    if not avail.ok:
        raise DtypelabError(f"policy {policy} cannot run here: {avail.reason}")
    loaded_task = load_task(task)
    model, origin = _fp32_model(loaded_task, task, weights, seed)
    model.eval()
    fp32_bytes, fp32_linear = len(serialize(model)[0]), linear_weight_bytes(model)
    with calibrating(task_feed(loaded_task.inference_inputs(loaded_task.batch_size))):  # for GPTQ and AWQ
        converted = pol.convert_module(model).eval()
    meta = {"task": task, "policy": policy, "plan": plan.to_dict(), "weights": origin, "dtypelab": __version__,
            "torch": torch.__version__}
    blob, fmt = serialize(_eager(converted), meta)
    if not path.endswith(EXTENSIONS[fmt]):
        raise DtypelabError(f"policy {policy} is written with {fmt}: give a path ending in "
                            f"{' or '.join(EXTENSIONS[fmt])}, not {os.path.basename(path)!r}")
    save_bytes(path, blob)
    program = _eager(converted)
    lowered = program.lowered if isinstance(program, PteModule) else None
    if lowered is not None:  # a .pte holds no metadata of ours: the same, and the program's calling shape, beside it
        save_bytes(path + SIDECAR, json.dumps({**meta, "program": lowered.metadata()}, indent=1,
                                              sort_keys=True).encode())
    inputs = loaded_task.inference_inputs(min(loaded_task.batch_size, 8))
    reloaded, _ = load_exported(path, task=loaded_task)
    diff = (_outputs(converted, pol, inputs) - _outputs(reloaded, pol, inputs)).abs().max().item()
    return ExportInfo(path, task, policy, fmt, len(blob), fp32_bytes, linear_weight_bytes(converted), fp32_linear,
                      diff, origin, lowered.planned_bytes if lowered is not None else None,
                      (lowered.batch, lowered.max_len, lowered.cache_bytes) if lowered and lowered.max_len else None)


def read_metadata(path: str) -> dict[str, Any]:
    """The ``dtypelab`` metadata of an exported file: task, policy and its plan, weights, versions."""
    return _read(path)[1]


def _read(path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(tensors or state dict, dtypelab metadata, raw safetensors metadata)."""
    if not os.path.isfile(path):
        raise DtypelabError(f"no such file: {path}")
    if path.endswith(EXTENSIONS[PTE]):
        return {}, _pte_metadata(path), {}
    try:
        if path.endswith(EXTENSIONS[SAFETENSORS]):
            from safetensors import safe_open

            with safe_open(path, "pt") as f:
                raw = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        else:
            with warnings.catch_warnings():  # torch's own TypedStorage notice when it unpickles quantized tensors
                warnings.simplefilter("ignore")
                blob = torch.load(path, map_location="cpu", weights_only=True)
            tensors, raw = blob["state_dict"], blob["metadata"]
        return tensors, json.loads(raw["dtypelab"]), raw
    except Exception as exc:  # safetensors' own error type, pickle errors, missing keys: all mean "not ours"
        raise DtypelabError(f"{path} is not a file written by dtypelab export ({type(exc).__name__}: {exc})") from None


def _pte_metadata(path: str) -> dict[str, Any]:
    """A .pte's metadata, from the JSON written beside it (read as data: nothing in either file is run here)."""
    try:
        with open(path + SIDECAR) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("program"), dict):
            raise ValueError("no 'program' entry")
        return meta
    except (OSError, ValueError) as exc:
        raise DtypelabError(f"{path}: its dtypelab metadata {os.path.basename(path) + SIDECAR} is missing or broken "
                            f"({type(exc).__name__}: {exc}); re-export it with dtypelab export") from None


def _load_pte(path: str, meta: dict[str, Any]) -> nn.Module:
    """The program as written, run by ExecuTorch's runtime: no task, no policy, no Python of anyone's."""
    why = missing()
    if why:
        raise DtypelabError(f"{path}: {why}")
    with open(path, "rb") as f:
        program = f.read()
    try:
        return program_module(Lowered.from_metadata(program, meta["program"]))
    except DtypelabError:
        raise
    except Exception as exc:  # the runtime's own error for a file that is no program
        raise DtypelabError(f"{path} is not a program ExecuTorch's runtime loads ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _named_task(path: str, meta: dict[str, Any]) -> str:
    """The task a file names, when it is a built-in: a file's metadata is data, and a task file or module it names
    is imported only when the caller names it (``task=``)."""
    named = str(meta.get("task", ""))
    if named in BUILTIN:
        return named
    raise DtypelabError(f"{path} was exported from task {named!r}, which dtypelab does not import because a file "
                        f"names it (reading a file never runs code): pass it yourself, load_exported(path, "
                        f"task={named!r})")


def _named_policy(path: str, meta: dict[str, Any]) -> str:
    named = str(meta.get("policy", ""))
    if ":" in named:  # a user's precision file: imported only when the caller names it
        raise DtypelabError(f"policy {named!r} is defined in a file, which dtypelab does not import because a file "
                            f"names it (reading a file never runs code): load it yourself first, "
                            f"dtypelab.get_policy({named!r})")
    return named


def load_exported(path: str, task: str | Task | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """(model, metadata) from a file written by :func:`export`, in eval mode on the CPU. ``task`` overrides
    the task named in the file (when its file has moved); a task the file names that is not a built-in must be given
    here, since reading a file never imports code it names."""
    tensors, meta, raw = _read(path)
    if path.endswith(EXTENSIONS[PTE]):
        return _load_pte(path, meta).eval(), meta
    task_obj = task if isinstance(task, Task) else load_task(task or _named_task(path, meta))
    try:  # files from before plans were stored name a registered policy only
        plan = Plan.from_dict(meta["plan"]) if "plan" in meta else get_policy(_named_policy(path, meta))
    except DtypelabError as exc:
        raise DtypelabError(f"{path}: {exc}") from None
    pol = Precision(plan, "cpu")
    torch.manual_seed(0)
    with calibrating(task_feed(task_obj.inference_inputs(task_obj.batch_size))):  # the stored values replace these
        target = _eager(pol.convert_module(task_obj.make_model()))
    state = tensors
    if "tensor_names" in raw:  # torchao subclasses flattened by sizes.flatten_state

        support = torchao_module("prototype.safetensors.safetensors_support")
        state, leftover = support.unflatten_tensor_state_dict(tensors, raw)
        state = {**leftover, **state}
    missing, unexpected = target.load_state_dict(state, strict=False, assign=True)
    tied = set(target.state_dict()) - set(dedupe_state(target.state_dict()))  # stored once, shared in the model
    if unexpected or set(missing) - tied:
        raise DtypelabError(f"{path} does not match task {task_obj.name} under {meta['policy']}: "
                            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return target.eval(), meta
