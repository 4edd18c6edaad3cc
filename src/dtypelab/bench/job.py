"""One policy's measurement, run inside its own process (or in-process with isolate=False)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError, TaskError, describe_exception
from dtypelab.core.hardware import HardwareInfo, probe, resolve_device
from dtypelab.core.measure import MemoryMeter, StepTimer, device_sync, model_bytes
from dtypelab.core.policies import BASELINE, Policy, policy_class
from dtypelab.core.results import PolicyResult
from dtypelab.core.task import Task, call_model, load_task, map_tensors
from dtypelab.inference.fidelity import compare, value_count
from dtypelab.inference.perlayer import layer_fidelity
from dtypelab.inference.sizes import linear_weight_bytes, serialize

Progress = Callable[[int, int], None]  # (steps done, total)
DIVERGED_PATIENCE = 10  # consecutive non-finite losses before a run is declared diverged and stopped
RECORD_LIMIT = 2**24  # output values kept from evaluation for the fidelity comparison (64 MB as float32)


@dataclass(frozen=True)
class Job:
    """Everything a child needs, picklable: the task travels as its spec and is re-loaded there."""

    task_spec: str
    policy: str
    mode: str  # "train", "infer", or "reference" (train fp32 and save weights for inference runs)
    steps: int
    batch_size: int
    warmup: int
    seed: int
    device: str
    workdir: str  # shared by all jobs of one sweep: initial weights, reference weights and outputs
    threads: int | None = None
    per_layer: bool = False  # infer: also compare every layer's output with the fp32 model's

    @property
    def init_path(self) -> str:
        return os.path.join(self.workdir, "init.pt")

    @property
    def reference_weights(self) -> str:
        return os.path.join(self.workdir, "reference.pt")

    @property
    def reference_outputs(self) -> str:
        return os.path.join(self.workdir, "reference_outputs.pt")


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


def build_model(task: Task, job: Job, weights: str | None) -> tuple[nn.Module, str]:
    """The task's model with the sweep's shared weights: the first job saves them, later ones load.

    Loading a saved copy (rather than trusting the seed) guarantees identical initial weights even
    when the user's factory draws from an unseeded RNG.
    """
    torch.manual_seed(job.seed)
    model = task.make_model()
    if weights and os.path.exists(weights):
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    elif weights:
        _atomic_save(model.state_dict(), weights)
    return model, _fingerprint(model)


def prepare_single(task: str | Task, policy: str, device: str | None, hardware: HardwareInfo | None,
                   force: bool) -> tuple[str, Task, torch.device, Policy, HardwareInfo]:
    """(task spec, task, device, policy, hardware) for the single-process commands (audit, trace); an
    error when the policy cannot run here or was measured pathologically slow and not ``force``."""
    spec = task if isinstance(task, str) else task.name
    task_obj = load_task(task) if isinstance(task, str) else task
    dev = resolve_device(device)
    pol = policy_class(policy)(dev)
    wrong_mode = pol.mode_error("train") or (
        f"task {task_obj.name} is inference-only: nothing to train" if task_obj.inference_only else None)
    if wrong_mode:
        raise DtypelabError(wrong_mode)
    hardware = hardware or probe(dev, budget_s=0.02)
    pol.require(hardware, force)
    return spec, task_obj, dev, pol, hardware


def build_trainable(task: Task, policy: Policy, device: torch.device, seed: int) -> tuple[nn.Module, Any]:
    """The task's model under the policy, in train mode, and its optimizer (single-process commands: audit,
    trace). A failure in the user's factories is a TaskError naming their line."""
    torch.manual_seed(seed)
    try:
        model = policy.convert_module(task.make_model().to(device))
        model.train()
        return model, task.make_optimizer(model.parameters())
    except Exception as exc:
        raise TaskError(f"building the model raised {describe_exception(exc)}") from exc


def make_predict(model: nn.Module, policy: Policy, device: torch.device) -> Callable[[Any], Any]:
    """Run the model under the policy on a batch; outputs come back as float32 on the CPU."""

    def predict(inputs: Any) -> Any:
        with torch.no_grad(), policy.forward_context():
            out = call_model(model, policy.convert_inputs(map_tensors(lambda t: t.to(device), inputs)))
        return map_tensors(lambda t: t.detach().float().cpu() if t.is_floating_point() else t.cpu(), out)

    return predict


def _evaluate(task: Task, model: nn.Module, policy: Policy, device: torch.device,
              record: list[Any] | None = None) -> dict[str, float]:
    """The task's metrics under the policy; ``record`` collects the outputs it saw (up to RECORD_LIMIT values)."""
    was_training = model.training
    model.eval()
    predict = make_predict(model, policy, device)
    if record is not None:
        kept = [0]

        def recording(inputs: Any) -> Any:
            out = predict(inputs)
            size = value_count(out)
            if kept[0] + size <= RECORD_LIMIT:
                kept[0] += size
                record.append(out)
            return out
    try:
        return {k: float(v) for k, v in task.evaluate(predict if record is None else recording).items()}
    finally:
        model.train(was_training)


def _train_step(task: Task, model: nn.Module, policy: Policy, optimizer: torch.optim.Optimizer,
                inputs: Any, target: Any, after_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """One training step through the policy's hooks: the part of the loop that is timed.
    ``after_backward`` sees the gradients before the optimizer consumes them (the audit's hook)."""
    inputs, target = policy.convert_inputs(inputs), policy.convert_inputs(target)
    optimizer.zero_grad(set_to_none=True)
    with policy.forward_context():
        loss = task.loss_fn(call_model(model, inputs), target)
    policy.backward(loss)
    if after_backward is not None:
        after_backward()
    policy.optimizer_step(optimizer)
    return loss


def _prime(task: Task, job: Job, train_step: bool) -> None:
    """Two throwaway steps on a separate model, under a separate policy instance, so PyTorch creates
    its lazy runtime state (thread pools, kernel and optimizer caches) before the memory baseline."""
    device = torch.device(job.device)
    policy = policy_class(job.policy)(device)
    model = policy.convert_module(task.make_model().to(device))
    optimizer = task.make_optimizer(model.parameters()) if train_step else None
    if train_step:
        inputs, target = map_tensors(lambda t: t.to(device), task.train_batch(0, job.batch_size))
    else:
        inputs = map_tensors(lambda t: t.to(device), task.inference_inputs(job.batch_size))
    with policy.session():
        for _ in range(2):
            if optimizer is None:
                make_predict(model, policy, device)(inputs)
            else:
                _train_step(task, model, policy, optimizer, inputs, target)
    del model, optimizer


def train(task: Task, job: Job, policy: Policy, progress: Progress) -> PolicyResult:
    device = torch.device(job.device)
    if device.type == "cpu":
        _prime(task, job, train_step=True)
    meter = MemoryMeter(device)
    meter.start()  # before the model exists: weights, optimizer state and activations all count
    model, fingerprint = build_model(task, job, job.init_path)
    model = policy.convert_module(model.to(device))
    model.train()
    optimizer = task.make_optimizer(model.parameters())
    timer = StepTimer(sync=device_sync(device))
    losses: list[float] = []
    first_bad, bad_run = None, 0
    torch.manual_seed(job.seed)  # same dropout masks etc. for every policy
    with policy.session():
        for step in range(job.steps):
            inputs, target = map_tensors(lambda t: t.to(device), task.train_batch(step, job.batch_size))
            timer.start()
            loss = _train_step(task, model, policy, optimizer, inputs, target)
            timer.stop()
            value = float(loss.detach())
            losses.append(value)
            if math.isfinite(value):
                bad_run = 0
            else:
                first_bad = step if first_bad is None else first_bad
                bad_run += 1
            progress(step + 1, job.steps)
            if bad_run >= DIVERGED_PATIENCE:
                break
        peak = meter.peak_bytes()
        metrics = _evaluate(task, model, policy, device)
    if job.mode == "reference":
        _atomic_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, job.reference_weights)
    diverged = first_bad is not None and not (losses and math.isfinite(losses[-1]))
    reason = f"loss non-finite from step {first_bad}" if diverged else ""
    if bad_run >= DIVERGED_PATIENCE:
        reason += f"; stopped after {DIVERGED_PATIENCE} non-finite steps"
    return PolicyResult(
        policy=job.policy, status="diverged" if diverged else "ok", reason=reason,
        batch_size=job.batch_size, warmup=min(job.warmup, max(0, len(timer.samples) - 1)),
        step_times_s=tuple(timer.samples), losses=tuple(losses), first_nonfinite_step=first_bad,
        metrics=metrics, peak_memory_bytes=peak, memory_method=meter.method,
        model_bytes=model_bytes(model), init_fingerprint=fingerprint, extras=policy.stats(),
    )


def infer(task: Task, job: Job, policy: Policy, progress: Progress) -> PolicyResult:
    device = torch.device(job.device)
    weights = None if task.pretrained else job.reference_weights
    if device.type == "cpu" and not policy.compiles:  # priming a compiled policy would compile it twice
        _prime(task, job, train_step=False)
    meter = MemoryMeter(device)
    meter.start()
    model, fingerprint = build_model(task, job, weights)
    model = policy.convert_module(model.to(device)).eval()
    inputs = map_tensors(lambda t: t.to(device), task.inference_inputs(job.batch_size))
    timer = StepTimer(sync=device_sync(device))
    with policy.session(), torch.no_grad():
        for i in range(job.steps):
            timer.start()
            with policy.forward_context():
                call_model(model, policy.convert_inputs(inputs))
            timer.stop()
            progress(i + 1, job.steps)
        peak = meter.peak_bytes()
        outputs: list[Any] = []  # what the task's evaluation ran the model on: the fidelity set
        metrics = _evaluate(task, model, policy, device, record=outputs)
        if not outputs:
            outputs.append(make_predict(model, policy, device)(inputs))
        layers = None
        if job.per_layer:
            reference, _ = build_model(task, job, weights)
            layers = layer_fidelity(reference.to(device).eval(), model, inputs, policy)
    if job.policy == BASELINE:
        _atomic_save(outputs, job.reference_outputs)
    fidelity = compare(torch.load(job.reference_outputs, weights_only=True), outputs) \
        if os.path.exists(job.reference_outputs) else {}
    blob, fmt = serialize(model)
    extras: dict[str, Any] = {"size": {"format": fmt, "file_bytes": len(blob),
                                       "linear_weight_bytes": linear_weight_bytes(model)},
                              "first_call_s": timer.samples[0] if timer.samples else None}
    if layers is not None:
        extras["per_layer"] = layers
    return PolicyResult(
        policy=job.policy, status="ok", batch_size=job.batch_size,
        warmup=min(job.warmup, max(0, len(timer.samples) - 1)), step_times_s=tuple(timer.samples),
        metrics=metrics, fidelity=fidelity, peak_memory_bytes=peak, memory_method=meter.method,
        model_bytes=len(blob), init_fingerprint=fingerprint, extras=extras,
    )


def run_job(job: Job, progress: Progress | None = None, task: Task | None = None) -> PolicyResult:
    """Measure one policy. Exceptions become a failed result naming the user's line, never a crash."""
    progress = progress or (lambda done, total: None)
    start = time.perf_counter()
    try:
        task = task or load_task(job.task_spec)
        policy = policy_class(job.policy)(job.device)
        with _threads(job.threads):
            result = (infer if job.mode == "infer" else train)(task, job, policy, progress)
    except torch.cuda.OutOfMemoryError as exc:
        result = PolicyResult(job.policy, "oom", f"CUDA out of memory: {str(exc).splitlines()[0]}")
    except MemoryError:
        result = PolicyResult(job.policy, "oom", "out of host memory (MemoryError)")
    except Exception as exc:
        result = PolicyResult(job.policy, "failed", describe_exception(exc))
    return PolicyResult(**{**result.__dict__, "wall_s": time.perf_counter() - start})
