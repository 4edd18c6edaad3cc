"""dtypelab for the Hugging Face Trainer: ``trainer = dtypelab.hf.Trainer(..., metric="eval_accuracy")`` in
place of ``transformers.Trainer(...)`` — the one changed line. Run normally it is the Trainer as given; run by
``dtypelab bench train.py``, the policy is mapped onto ``TrainingArguments`` (``bf16`` / ``fp16`` for autocast,
``tf32``) or applied to the model (a pure bf16 / fp16 / fp64 cast, as loading with that ``torch_dtype`` would; a
LoRA policy's adapters, or a peft model's own kept, and its base in the policy's format),
every step's loss is logged, and a callback times each step and keeps the evaluation metrics (the last
``trainer.evaluate()`` before the script ends counts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies import Plan
from dtypelab.script import HF_CONVERTS, HF_OPTIM, Session, trainer_arguments

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the [hf] extra
    raise DtypelabError("dtypelab.hf needs transformers: pip install 'dtypelab[hf]'") from exc


ADAMW = ("adamw_torch", "adamw_torch_fused")  # the Trainer's own AdamW, whose state a modifier stores in fewer bits


def training_arguments(plan: Plan, args: Any) -> tuple[Any, str | None]:
    """(TrainingArguments for the policy, the dtype to cast the model to or None); an error for a policy the
    Trainer cannot express. An optimizer-state modifier becomes the Trainer's ``optim`` (``adamw_torch_8bit``,
    ``adamw_torch_4bit``: torchao's low-bit AdamW), ``+ckpt`` its ``gradient_checkpointing``."""
    mapped = trainer_arguments(plan)
    if mapped is None:
        why = "per-module plans have" if plan.rules else "it has"
        raise DtypelabError(f"policy {plan.name}: {why} no TrainingArguments equivalent")
    flags, cast = mapped
    flags = {"bf16": False, "fp16": False, **flags}
    if plan.state is not None:
        optim = HF_OPTIM(plan.state)
        if optim is None:
            raise DtypelabError(f"policy {plan.name}: the Trainer has no optim for {plan.state.label}; it has "
                                "adamw_torch_8bit and adamw_torch_4bit (+adam8bit, +adam4bit)")
        given = str(getattr(args.optim, "value", args.optim))
        if given not in ADAMW:
            raise DtypelabError(f"policy {plan.name}: {plan.state.label} stores AdamW's state in fewer bits, and this "
                                f"Trainer's optim is {given}")
        flags["optim"] = optim
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; each policy checkpoints as named,
    # whatever the script's arguments said (TRL's SFTConfig turns it on by default)
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    flags[name] = bool(plan.checkpoint)
    if plan.checkpoint:
        flags[f"{name}_kwargs"] = {"use_reentrant": False}
    return dataclasses.replace(args, logging_steps=1, **flags), cast


def replaced_settings(args: Any, flags: dict[str, Any]) -> list[str]:
    """What the script's TrainingArguments set (precision, checkpointing) that the policy's ``flags`` set otherwise:
    "bf16=True", "gradient_checkpointing=True"."""
    keys = ("bf16", "fp16", "tf32", "activation_checkpointing", "gradient_checkpointing")
    out = [f"{k}={getattr(args, k)}" for k in keys
           if k in flags and getattr(args, k, None) and getattr(args, k) != flags[k]]
    if any(s.startswith("activation_") for s in out):  # transformers 5's name for it; the old one is its alias
        out = [s for s in out if not s.startswith("gradient_")]
    return out


def _on_device(args: Any, device: torch.device) -> Any:
    """The run's device, as the job chose it (the Trainer refuses bf16 autocast on a CPU unless told use_cpu)."""
    return dataclasses.replace(args, use_cpu=device.type == "cpu") if args.use_cpu != (device.type == "cpu") else args


class DtypelabCallback(transformers.TrainerCallback):
    def __init__(self, lab: Session, metric: str | None, higher_is_better: bool | None) -> None:
        self.lab, self.metric, self.higher = lab, metric, higher_is_better

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if model is not None:
            self.lab.frameworks.attach(model, kw.get("optimizer"))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # the step's gradients, before the Trainer's optimizer consumes them and its zero_grad drops them
        self.lab.footprint.before_zero_grad()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.lab.step_begin()
        self.lab.frameworks.add_samples(args.train_batch_size * args.gradient_accumulation_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.lab.step_end()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.lab.frameworks.record_loss(logs["loss"])

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kw: Any) -> None:
        if metrics:
            chosen = {k: v for k, v in metrics.items() if not self.metric or k == self.metric}
            self.lab.frameworks.record_metrics(chosen, self.higher, primary=self.metric)


def Trainer(*args: Any, metric: str | None = None, higher_is_better: bool | None = None,
            seed: int | None = None, **kwargs: Any) -> Any:
    """``transformers.Trainer(*args, **kwargs)`` measured by dtypelab (keyword ``model=`` and ``args=``).
    ``metric``: the evaluation metric to judge policies by (e.g. "eval_accuracy"; default: the first one). ``seed``
    is accepted for old scripts and ignored: the Trainer seeds from ``TrainingArguments.seed`` as it always does."""
    return _measured(transformers.Trainer, Session(seed=seed), args, kwargs, metric, higher_is_better)


def SFTTrainer(*args: Any, metric: str | None = None, higher_is_better: bool | None = None, **kwargs: Any) -> Any:
    """``trl.SFTTrainer(*args, **kwargs)`` measured by dtypelab, as ``Trainer`` is (keyword ``model=``, a model
    object, and ``args=``, an ``SFTConfig``). A ``peft_config`` is applied by SFTTrainer as always (its added tokens,
    its dtype rules); a LoRA policy then keeps those adapters and puts the base in its format."""
    try:
        import trl
    except ImportError as exc:
        raise DtypelabError("dtypelab.hf.SFTTrainer needs TRL: pip install trl") from exc
    return _measured(trl.SFTTrainer, Session(), args, kwargs, metric, higher_is_better)


def _measured(cls: type, lab: Session, args: tuple[Any, ...], kwargs: dict[str, Any], metric: str | None,
              higher_is_better: bool | None) -> Any:
    """``cls(*args, **kwargs)``, a Trainer or a subclass of it, with dtypelab's callback, and, when dtypelab drives
    the run, its arguments and model as the policy says."""
    adapts = kwargs.get("peft_config") is not None  # the trainer makes the adapters: converted once it has
    if lab.driven:
        _driven(cls.__name__, lab, kwargs, convert=not adapts)
    kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), DtypelabCallback(lab, metric, higher_is_better)]
    trainer = cls(*args, **kwargs)
    if lab.driven and adapts and HF_CONVERTS(lab.plan.default):  # before train() builds the optimizer from it
        trainer.model, _ = lab.plan.default.convert_module(trainer.model, [])
        trainer.model_wrapped = trainer.model
    if lab.driven and lab.plan.default.facts.autocast_dtype and not trainer.accelerator.native_amp:
        # accelerate accepts fp16=True on a CPU but runs plain float32: measuring that as amp-fp16 would lie
        lab.unsupported(f"the Hugging Face Trainer does not autocast to {lab.plan.default.facts.autocast_dtype} on "
                        f"{lab.device.type} (accelerate's native_amp is off): {lab.plan.name} cannot run through it "
                        "here")
    return trainer


def _driven(name: str, lab: Session, kwargs: dict[str, Any], convert: bool) -> None:
    """The Trainer's keyword arguments as the policy says: its TrainingArguments, the model cast, or (LoRA, with
    ``convert``) the model's adapters, its own or dtypelab's, over a base in the policy's format."""
    if "args" not in kwargs or "model" not in kwargs:
        raise DtypelabError(f"dtypelab.hf.{name} needs model= and args= as keywords")
    if isinstance(kwargs["model"], str):
        raise DtypelabError(f"dtypelab.hf.{name}: model= names {kwargs['model']!r}; give the model object "
                            "(from_pretrained), which dtypelab converts as each policy says")
    given = kwargs["args"]
    kwargs["args"], cast = training_arguments(lab.plan, _on_device(given, lab.device))
    lab.run_state.script_settings.update(replaced_settings(given, vars(kwargs["args"])))
    if cast is not None:
        kwargs["model"] = kwargs["model"].to(getattr(torch, cast))
    if convert and HF_CONVERTS(lab.plan.default):  # LoRA: the adapters (or the model's own) and the base in its format
        kwargs["model"], _ = lab.plan.default.convert_module(kwargs["model"], [])
