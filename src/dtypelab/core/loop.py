"""The one training / evaluation loop that bench, audit, trace and export share: build the task's model
under a precision, take a step through its hooks, predict, evaluate."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtypelab.core.calibration import calibrating, task_feed
from dtypelab.core.errors import DtypelabError, TaskError, Unsupported, describe_exception
from dtypelab.core.footprint import leaves, part_records, saved_activations, state_memory
from dtypelab.core.machine.hardware import HardwareInfo, hardware_for, resolve_device
from dtypelab.core.policies import Plan, Precision, get_policy
from dtypelab.core.policies.loss import loss_choice
from dtypelab.core.task import Task, call_model, load_task, map_tensors, plain
from dtypelab.core.updates import UpdateCounter

# a context entered around one evaluation forward pass, given its batch (already on the device)
Around = Callable[[Any], contextlib.AbstractContextManager[Any]]
RECORD_LIMIT = 2**24  # output values kept from evaluation for the fidelity comparison (64 MB as float32)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block (None: unchanged), then restored."""
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's state: equal across policies when they start from the same weights. Hashes the
    raw bytes (no float64 copies: this runs before the memory window, but it should stay cheap)."""
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        for leaf in leaves(t):  # a quantized weight (NF4, int8) by its inner tensors: it has no bytes of its own
            flat = leaf.detach().to("cpu").reshape(-1)
            if flat.numel() and flat.stride(0) != 1:  # a one-element view may keep another stride: bytes need 1
                flat = flat.clone(memory_format=torch.contiguous_format)
            h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_model(task: Task, seed: int, weights: str | None = None) -> nn.Module:
    """The task's model with shared weights: when ``weights`` exists it is loaded, else (when given) the
    fresh model is saved there. Loading a saved copy, rather than trusting the seed, guarantees identical
    initial weights even when the user's factory draws from an unseeded RNG."""
    torch.manual_seed(seed)
    model = task.make_model()
    if weights and os.path.exists(weights):
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    elif weights:
        atomic_save(model.state_dict(), weights)
    return model


def prepare(task: str | Task, policy: str | Plan, device: str | None, hardware: HardwareInfo | str | None,
            force: bool) -> tuple[str, Task, torch.device, Precision, HardwareInfo]:
    """(task spec, task, device, precision, hardware) for the single-process training commands (audit,
    trace): an error when the policy cannot train, cannot run here, or was measured pathologically slow
    here and not ``force``."""
    spec = task if isinstance(task, str) else task.name
    task_obj = load_task(task) if isinstance(task, str) else task
    dev = resolve_device(device)
    plan = get_policy(policy)
    wrong_mode = plan.mode_error("train") or (
        f"task {task_obj.name} is inference-only: nothing to train" if task_obj.inference_only else None)
    if wrong_mode:
        raise DtypelabError(wrong_mode)
    hardware = hardware_for(dev, hardware, budget_s=0.02)
    plan.require(hardware, force)
    return spec, task_obj, dev, Precision(plan, dev), hardware


def build_trainable(task: Task, precision: Precision, device: torch.device, seed: int = 0, *,
                    model: nn.Module | None = None, train: bool = True,
                    wrap: Callable[[nn.Module], nn.Module] | None = None) -> tuple[nn.Module, Any]:
    """The task's model (``model``, or a new one seeded ``seed``) under the precision, in train mode (``train``),
    and its optimizer as the precision's kinds convert it (None when not ``train``): the one place a task's
    optimizer is made. ``wrap`` wraps the converted model first (DDP, FSDP). A failure in the user's factories is a
    TaskError naming their line."""
    try:
        if model is None:
            torch.manual_seed(seed)
            model = task.make_model()
        model = precision.convert_module(model.to(device))
        if wrap is not None:
            model = wrap(model)
        model.train(train)
        if not train:
            return model, None
        return model, precision.convert_optimizer(task.make_optimizer(model.parameters()), model)
    except DtypelabError:
        raise
    except Exception as exc:
        raise TaskError(f"building the model raised {describe_exception(exc)}") from exc


def to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), batch)


Mark = Callable[[str], contextlib.AbstractContextManager[Any]]  # a phase of the step: "forward", "backward", …


def _unmarked(phase: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def train_step(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer,
               inputs: Any, target: Any, after_backward: Callable[[], None] | None = None,
               mark: Mark = _unmarked) -> torch.Tensor:
    """One training step through the precision's hooks: the part of the loop that bench times.
    ``after_backward`` sees the gradients before the optimizer consumes them (the audit's hook); ``mark``
    brackets the phases (forward with the loss, backward, optimizer) for the profiler."""
    with mark("forward"):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(task, model, precision, inputs, target)
    with mark("backward"):
        precision.backward(loss)
    if after_backward is not None:
        after_backward()
    with mark("optimizer"):
        precision.optimizer_step(optimizer)
    return loss


def forward_loss(task: Task, model: nn.Module, precision: Precision, inputs: Any, target: Any) -> torch.Tensor:
    """The training forward pass and its loss under the precision (no backward)."""
    inputs, target = precision.convert_input(inputs), precision.convert_input(target)
    with precision.forward_context():
        if precision.plan.loss:  # a loss choice: computed from the model's last hidden states (policies.loss)
            return chosen_loss(task, precision.plan)(task.head_inputs(model, inputs))  # type: ignore[misc]
        if task.compute_loss is not None:
            return task.compute_loss(model, inputs)
        return task.loss_fn(call_model(model, inputs), target)


def chosen_loss(task: Task, plan: Plan) -> Callable[[Any], torch.Tensor]:
    """The loss the plan names, for a task that offers the loss's inputs; one line for one that does not."""
    label = plan.loss
    if task.head_inputs is None:
        raise Unsupported(f"+{label}: task {task.name!r} gives no output projection to compute its loss from (an hf: "
                          "causal language model does; a task of your own sets Task.head_inputs)")
    return loss_choice(label, compiled=plan.compiles)


LOW_FLOATS = (torch.bfloat16, torch.float16)
PROBE_STEPS = 4  # steps after the metric in which a low-precision run's lost updates are counted


def state_after(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer,
                device: torch.device, batch_size: int, step: int) -> dict[str, Any]:
    """Where the training memory goes now (``footprint.state_memory``), the activations counted on one forward pass
    of training batch ``step`` (no step is taken; None under torch.compile, whose graphs save tensors out of the
    hooks' sight)."""
    activations, parts = None, []
    if not precision.plan.compiles:
        inputs, target = to_device(task.batch(step, batch_size), device)
        named = precision.activation_parts(model)
        with precision.session(), saved_activations(model, named) as saved:
            loss = forward_loss(task, model, precision, inputs, target)
        del loss
        activations, parts = saved["bytes"], part_records(named, saved)
    memory: dict[str, Any] = state_memory(model, [optimizer], precision.master_tensors(optimizer), activations)
    return {**memory, "parts": parts} if parts else memory


def lost_updates(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer,
                 device: torch.device, batch_size: int, start: int, steps: int = PROBE_STEPS) -> list[dict[str, Any]]:
    """For a run whose weights are bfloat16 / float16 with nothing to keep their small updates: ``steps`` more
    training steps (batches from ``start``), counting per parameter the share of elements whose weight stayed the
    same though its gradient was not zero (``updates.UpdateCounter``), worst first. Empty for any other run."""
    if any(c.facts.keeps_updates for c in precision.plan.configs) or not any(
            p.dtype in LOW_FLOATS for p in model.parameters()):
        return []
    counter = UpdateCounter([(n, p) for n, p in model.named_parameters() if p.dtype in LOW_FLOATS], formats=None)
    with precision.session():
        for step in range(start, start + steps):
            inputs, target = to_device(task.batch(step, batch_size), device)
            scale = precision.grad_scale()
            train_step(task, model, precision, optimizer, inputs, target, after_backward=counter.before)
            counter.after(skipped=precision.grad_scale() < scale)  # GradScaler skipped the step: nothing to count
    return sorted(counter.rows(), key=lambda r: -next(iter(r["lost"].values()), 0.0))


def forward(model: nn.Module, precision: Precision, inputs: Any) -> Any:
    """One inference forward pass under the precision (inputs already on the model's device)."""
    with precision.forward_context():
        return call_model(model, precision.convert_input(inputs))


def make_predict(model: nn.Module, precision: Precision, device: torch.device,
                 around: Around | None = None) -> Callable[[Any], Any]:
    """Run the model under the precision on a batch; outputs come back as float32 on the CPU. ``around(batch)``,
    if given, is a context entered around the forward pass alone (not the copies to and from the device)."""

    def predict(inputs: Any) -> Any:
        inputs = to_device(inputs, device)
        with torch.no_grad(), (around(inputs) if around is not None else contextlib.nullcontext()):
            out = forward(model, precision, inputs)
        return map_tensors(lambda t: t.detach().float().cpu() if t.is_floating_point() else t.cpu(), out)

    return predict


def value_count(outputs: Any) -> int:
    """How many values the tensors of a nested output hold."""
    counts: list[int] = []
    map_tensors(lambda t: counts.append(t.numel()) or t, outputs)
    return sum(counts)


def evaluate(task: Task, model: nn.Module, precision: Precision, device: torch.device,
             record: list[Any] | None = None, around: Around | None = None) -> dict[str, float]:
    """The task's metrics under the precision; ``record`` collects the outputs it saw (up to RECORD_LIMIT
    values), the set inference fidelity is measured on; ``around`` wraps each forward pass (``make_predict``)."""
    was_training = model.training
    model.eval()
    predict = make_predict(model, precision, device, around)
    kept = 0

    def recording(inputs: Any) -> Any:
        nonlocal kept
        out = predict(inputs)
        size = value_count(out)
        if record is not None and kept + size <= RECORD_LIMIT:
            kept += size
            record.append(plain(out))  # saved and reloaded with weights_only=True
        return out

    try:
        return {k: float(v) for k, v in task.evaluate(recording).items()}
    finally:
        model.train(was_training)


def prime(task: Task, plan: Plan, device: torch.device, batch_size: int, train: bool) -> None:
    """Two throwaway steps on a separate model under a separate precision, so PyTorch creates its lazy
    runtime state (thread pools, kernel and optimizer caches) before a memory baseline is taken."""
    precision = Precision(plan, device)
    if train:
        inputs, target = to_device(task.batch(0, batch_size), device)
    else:
        # thread pools and kernels exist after any batch; a small one costs 0.35 s on minilm instead of 2.7 s
        inputs = to_device(task.inference_inputs(min(batch_size, 2)), device)
    with calibrating(task_feed(inputs)):  # a calibrated format (GPTQ) reads the inputs
        model, optimizer = build_trainable(task, precision, device, model=task.make_model(), train=train)
    with precision.session():
        for _ in range(2):
            if optimizer is None:
                with torch.no_grad():
                    forward(model, precision, inputs)
            else:
                train_step(task, model, precision, optimizer, inputs, target)
    del model, optimizer


DIVERGED_PATIENCE = 10  # consecutive non-finite losses before a run is declared diverged and stopped


@dataclass
class Fit:
    """What a training run did: the loss at every step, the first non-finite one, whether it was stopped."""

    losses: list[float] = field(default_factory=list)
    first_nonfinite: int | None = None
    stopped: bool = False  # DIVERGED_PATIENCE non-finite losses in a row
    cut: str = ""  # why ``stop_if`` ended the run early (e.g. measured pathologically slow)

    @property
    def diverged(self) -> bool:
        return self.first_nonfinite is not None and not (self.losses and math.isfinite(self.losses[-1]))


@dataclass(frozen=True)
class Watch:
    """What follows a run as it goes: ``progress(done, total)`` after each step, and ``stop_if(samples)``, a reason
    to stop it early from the step times so far ("" to go on)."""

    progress: Callable[[int, int], None] | None = None
    stop_if: Callable[[list[float]], str] | None = None


def fit(task: Task, model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer, device: torch.device,
        steps: int, batch_size: int, seed: int, timer: Any = None, watch: Watch = Watch()) -> Fit:
    """Train ``steps`` steps inside the precision's session. ``timer`` (start/stop) brackets each step after
    its batch is fetched; a run whose loss stays non-finite for DIVERGED_PATIENCE steps stops early, and so
    does one for which ``watch.stop_if(timer.samples)`` gives a reason."""
    progress, stop_if = watch.progress, watch.stop_if
    result, bad_run = Fit(), 0
    torch.manual_seed(seed)  # same dropout masks etc. for every policy
    with precision.session():
        for step in range(steps):
            inputs, target = to_device(task.batch(step, batch_size), device)
            if timer is not None:
                timer.start()
            loss = train_step(task, model, precision, optimizer, inputs, target)
            if timer is not None:
                timer.stop()
            value = float(loss.detach())
            result.losses.append(value)
            if math.isfinite(value):
                bad_run = 0
            else:
                result.first_nonfinite = step if result.first_nonfinite is None else result.first_nonfinite
                bad_run += 1
            if progress is not None:
                progress(step + 1, steps)
            if bad_run >= DIVERGED_PATIENCE:
                result.stopped = True
                break
            if stop_if is not None and timer is not None:
                result.cut = stop_if(timer.samples)
                if result.cut:
                    break
    return result
