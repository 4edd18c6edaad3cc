"""``LoRA``: fine-tuning with a frozen base and trained low-rank adapters (peft's ``LoraConfig`` /
``get_peft_model``, the standard), the base in float32, bfloat16, or quantized by torchao: NF4 with double-quantized
scales (QLoRA, torchtune's ``NF4Tensor``), int8 or float8 weights (``quantize_``).

What each policy is:

- ``lora-fp32``: float32 everywhere;
- ``lora-bf16``: a bfloat16 base, float32 adapters (peft's ``autocast_adapter_dtype``), autocast bfloat16;
- ``qlora-nf4``: every Linear of the base but the output head in NF4 (blocks of 64, their scales in int8 per 256:
  the paper's double quantization), the rest bfloat16, float32 adapters, bfloat16 compute;
- ``lora-int8``: int8 weights per channel; ``lora-fp8``: float8 e4m3 weights per row with float8 matmuls (compute
  capability >= 8.9), emulated elsewhere (``lora-fp8-emulated``: float8 storage, bfloat16 matmuls).

- ``lora-bf16-pure``, ``qlora-nf4-pure``: the same bases trained in pure bfloat16, as torchtune trains (its
  ``dtype: bf16``): the adapters and their Adam state in bfloat16, half their bytes, small updates rounded away.

Trainable weights are otherwise float32 (the adapters, and the modules trained in full: a new classification head,
peft's ``modules_to_save``), so no update is rounded away; the optimizer is rebuilt over them alone, each in the
parameter group of the weight it adapts. ``upcast`` adds what peft's ``prepare_model_for_kbit_training`` does to a
quantized model's other weights: every bfloat16 weight that is not quantized (norms, embeddings, the head) becomes
float32 (the GBs users meet, bitsandbytes#1569).
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dtypelab.core.backends import quiet, torchao_missing, torchao_module
from dtypelab.core.errors import DtypelabError, OptionError, Unsupported
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import ActivationPart, Config, Emulable, Facts, bf16_missing, cuda_missing
from dtypelab.core.policies.registry import in_default, register

# base -> (label, what the frozen base stores)
BASES = {"float32": ("lora-fp32", "float32"), "bfloat16": ("lora-bf16", "bfloat16"),
         "nf4": ("qlora-nf4", "NF4 (4-bit NormalFloat, blocks of 64, double-quantized scales)"),
         "int8": ("lora-int8", "int8 per output channel"), "fp8": ("lora-fp8", "float8 e4m3 per row")}
QUANTIZED = ("nf4", "int8", "fp8")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's: a scale per 64 weights, those scales quantized per 256
SAVED = ("classifier", "score")  # peft's modules_to_save for sequence classification: a new head, trained in full
PEFT = "pip install peft (or dtypelab[finetune])"
# what bench's memory table says of the adapters' inputs (an ActivationPart's note)
ADAPTER_INPUTS = ("of the activations, what LoRA's adapters keep for their backward (their inputs, which the frozen "
                  "layers beside them would not have kept, and autocast's copies of their weights)")


def nf4_fits(numel: int) -> bool:
    """Whether torchao's NF4 takes a weight of ``numel`` elements: whole blocks of 64, their scales in whole groups of
    256 (its copy, which ``deepcopy`` makes, re-quantizes with these sizes whatever the original's were)."""
    return numel % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0


def peft_missing() -> str | None:
    """Why LoRA cannot run for want of peft, or None. Found, not imported: importing peft (and transformers under it)
    costs the process asking about 5 s on 2 cores; the worker that converts a model imports it, and says so if that
    fails."""
    import importlib.util

    try:
        found = importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError) as exc:
        return f"LoRA needs peft ({type(exc).__name__}: {exc}); {PEFT}"
    return None if found else f"LoRA needs peft (it is not installed); {PEFT}"


def _matches(pattern: str, name: str) -> bool:
    """peft's rule (a module's name, or its last parts: ``q_proj`` matches ``layers.0.attn.q_proj``), a glob, or
    ``re:`` a regular expression on the whole name."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def output_head(model: nn.Module) -> str | None:
    """The model's output layer, which LoRA leaves as it is (peft's ``all-linear``): a Hugging Face model's output
    embeddings, else the last Linear in module order."""
    modules = dict(model.named_modules())
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Linear):
        return next((n for n, m in modules.items() if m is head), None)
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


@dataclass(frozen=True)
class Layout:
    """Which Linear layers of a model a LoRA config adapts, trains in full, and (quantized base) quantizes."""

    adapted: tuple[str, ...]
    saved: tuple[str, ...]
    quantized: tuple[str, ...]
    head: str | None
    own: tuple[str, ...] = ()  # the layers with adapters of the model's own (a peft model the user made): kept


def own_adapters(model: nn.Module) -> tuple[str, ...]:
    """The layers that carry LoRA adapters already (peft's ``lora_A``), none for a plain model."""
    return tuple(n for n, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
                 and len(m.lora_A))


def _adapter_part(name: str) -> bool:
    """Whether a Linear is part of an adapter (peft's ``lora_A`` / ``lora_B``), not a layer of the base."""
    return any(f".{part}." in f".{name}." for part in ("lora_A", "lora_B"))


@dataclass(frozen=True)
class LoRA(Emulable, Config):
    """A frozen base in ``base``'s format with LoRA adapters of rank ``rank`` (scaled ``alpha / rank``) on the
    Linear layers ``targets`` names (names, globs, ``re:`` patterns; none: every Linear but the output head)."""

    kind: ClassVar[str] = "lora"
    needs: ClassVar[str] = "float8 matmuls (CUDA compute capability >= 8.9)"
    base: str = "bfloat16"
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    upcast: bool = False
    emulate: bool = False  # fp8: float8 storage with bfloat16 matmuls, where float8 matmuls cannot run
    # what the trained weights (adapters, modules trained in full) and so their optimizer state are kept in: float32
    # (peft's default), or bfloat16 (pure bfloat16, as torchtune trains: ``-pure``)
    adapters: str = "float32"

    def __post_init__(self) -> None:
        if self.adapters not in ("float32", "bfloat16"):
            raise DtypelabError(f"lora: adapters are float32 or bfloat16, not {self.adapters!r}")
        if self.adapters == "bfloat16" and self.base == "float32":
            raise DtypelabError("lora: bfloat16 adapters are for a bfloat16 or quantized base (lora-fp32 is float32 "
                                "throughout)")
        if self.base not in BASES:
            raise DtypelabError(f"lora: unknown base {self.base!r}; use one of {', '.join(BASES)}")
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise DtypelabError(f"lora: rank must be >= 1 and alpha > 0 (got rank {self.rank}, alpha {self.alpha}), "
                                f"dropout in [0, 1) (got {self.dropout})")
        if self.upcast and self.base not in QUANTIZED:
            raise DtypelabError(f"lora: upcast is for a quantized base ({', '.join(QUANTIZED)}); a {self.base} base "
                                "would be upcast whole")
        if self.emulate and self.base != "fp8":
            raise DtypelabError("lora: only the fp8 base is emulated (float8 matmuls need a GPU)")
        object.__setattr__(self, "targets", tuple(self.targets))
        for t in self.targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as exc:
                    raise DtypelabError(f"--lora-targets: {t!r} is not a valid regular expression: {exc}") from None

    # --- what it is ------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return BASES[self.base][0] + ("-emulated" if self.emulate else "") + ("-upcast" if self.upcast else "") \
            + ("-pure" if self.adapters == "bfloat16" else "")

    @property
    def facts(self) -> Facts:
        dtype = "float32" if self.base == "float32" else "bfloat16"
        arithmetic = "the frozen weights dequantized to bfloat16 for every matmul" \
            if self.base in ("nf4", "int8") or self.emulate else ""
        return replace(self.emulable(Facts(
            modes=("train",), storage_dtype=dtype, compute_dtype=dtype, autocast_dtype=None if dtype == "float32"
            else dtype, probe="int8-weight-only" if self.base == "int8" else "", arithmetic=arithmetic,
            backend="peft + torchao" if self.base in QUANTIZED else "peft",
            keeps_updates=self.adapters == "float32")),  # float32 adapters keep every update
            gpu_only=self.base == "fp8" and not self.emulate)

    def describe(self) -> str:
        where = ", ".join(self.targets) if self.targets else "every Linear but the output head"
        what = f"frozen {BASES[self.base][1]} base; LoRA r={self.rank}, alpha={self.alpha:g} on {where} (peft)"
        if self.adapters == "bfloat16":
            what += ", bfloat16 adapters and Adam state (pure bfloat16, as torchtune trains)"
        elif self.base != "float32":
            what += ", float32 adapters, autocast bfloat16"
        if self.upcast:
            what += "; the other bfloat16 weights upcast to float32 (prepare_model_for_kbit_training)"
        return what + ("; emulated: float8 storage, bfloat16 matmuls" if self.emulate else "")

    def supported(self, hw: HardwareInfo) -> str | None:
        missing = peft_missing() or (torchao_missing() if self.base in QUANTIZED else None)
        if missing:
            return missing
        if self.base == "fp8" and not self.emulate:
            return cuda_missing(hw, "lora-fp8's float8 matmuls (torchao Float8DynamicActivationFloat8Weight)", (8, 9))
        return bf16_missing(hw, self.label) if self.base != "float32" else None

    def plan_error(self, plan: Any) -> str | None:
        if self != plan.default or plan.rules:
            return f"{self.label} fine-tunes the whole model: it is a plan's default, with no per-module rules"
        return None

    # --- what it does to a model --------------------------------------------------------------------
    def layout(self, model: nn.Module) -> Layout:
        """The layers adapted, trained in full and quantized, with a one-line error for targets that match no
        Linear layer. A model with adapters of its own keeps them: none is added, its base takes the format."""
        own = own_adapters(model)
        if own:
            return self._own_layout(model, own)
        modules = dict(model.named_modules())
        linears = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n]
        if not linears:
            raise Unsupported(f"{self.label}: the model has no Linear layers to adapt"
                              + (" or quantize" if self.base in QUANTIZED else ""))
        head = output_head(model)
        saved = tuple(n for n in modules if n and n.rpartition(".")[2] in SAVED)
        if self.targets:
            unmatched = [t for t in self.targets if not any(_matches(t, n) for n in linears)]
            if unmatched:
                ends = list(dict.fromkeys(n.rpartition(".")[2] for n in linears))
                raise DtypelabError(
                    f"--lora-targets {', '.join(unmatched)} matches none of the model's {len(linears)} Linear layers "
                    f"(their names end in {', '.join(_short(ends))})")
            adapted = tuple(n for n in linears if any(_matches(t, n) for t in self.targets))
        else:
            adapted = tuple(n for n in linears if n != head)
        adapted = tuple(n for n in adapted if not any(n == s or n.startswith(s + ".") for s in saved))
        if not adapted:
            raise DtypelabError(f"{self.label}: no Linear layer left to adapt (the only one is the output head, "
                                f"{head})")
        quantized = tuple(n for n in linears if n != head and n not in saved) if self.base in QUANTIZED else ()
        return Layout(adapted, saved, quantized, head)

    def _own_layout(self, model: nn.Module, own: tuple[str, ...]) -> Layout:
        """A peft model the user made: its adapters (and what it trains in full) as they are, its base's Linear
        layers quantized by a quantized base; ``--lora-targets`` has nothing to choose."""
        settings = (("--lora-rank", self.rank != LoRA.rank), ("--lora-alpha", self.alpha != LoRA.alpha),
                    ("--lora-targets", bool(self.targets)), ("--kbit-upcast", self.upcast))
        given = [flag for flag, changed in settings if changed]
        if given:
            raise OptionError(given, f"it has LoRA adapters of its own (on {len(own)} layers: "
                              f"{', '.join(_short(list(own), 2))}), which are measured as they are")
        head = output_head(model)
        trained = {n.rpartition(".")[0] for n, p in model.named_parameters() if p.requires_grad}
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n and not _adapter_part(n)
                   and n != head and n not in trained]
        return Layout((), (), tuple(linears) if self.base in QUANTIZED else (), head, own)

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        layout = self.layout(model)
        left_out = self._quantize(model, layout.quantized) if layout.quantized else []
        if layout.own:  # the model's own adapters, kept
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            form = f"{self.label} (the model's own adapters: {trainable:,} trainable)"
        else:
            self._inject(model, layout)
            form = self.label
        trained = getattr(torch, self.adapters)  # float32: no update rounded away; bfloat16: pure bfloat16
        for p in model.parameters():
            if p.requires_grad and p.dtype != trained:
                p.data = p.data.to(trained)
        # what the record says it converted: the layers quantized (a quantized base), else those with adapters
        skipped = {e["layer"] for e in left_out}
        converted = [n for n in layout.quantized if n not in skipped] if layout.quantized else \
            list(layout.own or layout.adapted)
        return model, {"format": form, "converted": converted, "left_out": left_out}

    def _inject(self, model: nn.Module, layout: Layout) -> None:
        """peft's adapters injected into the model itself (the rest frozen), after --kbit-upcast's float32 weights."""
        if self.upcast:  # prepare_model_for_kbit_training: every weight not quantized to float32
            for p in model.parameters():
                if p.dtype in (torch.bfloat16, torch.float16) and not is_traceable_wrapper_subclass(p):
                    p.data = p.data.float()
        with quiet():
            try:
                from peft import LoraConfig, get_peft_model
            except Exception as exc:  # found (peft_missing) but broken: an install for another transformers
                raise Unsupported(f"LoRA needs peft, which cannot be imported ({type(exc).__name__}: {exc}); "
                                  f"{PEFT}") from None

            config = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                                # one regular expression of the exact names: peft's list form also matches by suffix
                                target_modules="|".join(map(re.escape, layout.adapted)),
                                modules_to_save=list(layout.saved) or None)
            get_peft_model(model, config)

    def _quantize(self, model: nn.Module, names: Iterable[str]) -> list[dict[str, str]]:
        """The layers ``names`` quantized in place; those the format cannot take, with why (left as they are)."""
        chosen = set(names)
        if self.base == "nf4":
            nf4 = torchao_module("quantization").to_nf4
            left_out = []
            for name in sorted(chosen):
                layer = model.get_submodule(name)
                if not nf4_fits(layer.weight.numel()):  # kept in bfloat16
                    n, k = layer.weight.shape
                    left_out.append({"layer": name, "why": f"{n}×{k}: not whole groups of "
                                     f"{NF4_BLOCK * NF4_SCALER_BLOCK:,} weights (torchao's NF4)"})
                    continue
                weight = layer.weight.detach().to(torch.bfloat16)
                layer.weight = nn.Parameter(nf4(weight, NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
            return left_out
        q = torchao_module("quantization")
        if self.base == "int8":
            config = q.Int8WeightOnlyConfig(set_inductor_config=False)
        elif self.emulate:
            config = q.Float8WeightOnlyConfig(weight_dtype=torch.float8_e4m3fn, set_inductor_config=False)
        else:
            config = q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow(), set_inductor_config=False)
        with quiet():
            q.quantize_(model, config, filter_fn=lambda m, fqn: fqn in chosen)
        return []

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return adapters_optimizer(optimizer, model, self.label)

    def activation_parts(self, model: nn.Module) -> list[ActivationPart]:
        # an adapter's first matmul keeps its input for its weight's gradient, which the frozen layer beside it would
        # not have kept: LoRA's own activations (peft#2196)
        adapters = tuple(a for m in model.modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
                         for a in m.lora_A.values())
        return [ActivationPart("adapters' inputs", ADAPTER_INPUTS, adapters)]


def _short(names: list[str], n: int = 8) -> list[str]:
    return names[:n] + ([f"… ({len(names) - n} more)"] if len(names) > n else [])


def _origins(model: nn.Module) -> dict[int, int]:
    """Each trainable weight's origin: the frozen weight of the layer an adapter adapts, or the original of a weight
    peft copied to train in full (``modules_to_save``)."""
    origin: dict[int, int] = {}
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        adapters = [getattr(module, k, None) for k in ("lora_A", "lora_B")]
        if isinstance(base, nn.Module) and all(isinstance(a, nn.ModuleDict) for a in adapters):
            weight = getattr(base, "weight", None)
            for adapter in adapters:
                for p in adapter.parameters():
                    origin[id(p)] = id(weight)
        original = getattr(module, "original_module", None)
        saved = getattr(module, "modules_to_save", None)
        if isinstance(original, nn.Module) and isinstance(saved, nn.ModuleDict):
            by_name = dict(original.named_parameters())
            for copy in saved.values():
                for name, p in copy.named_parameters():
                    if name in by_name:
                        origin[id(p)] = id(by_name[name])
    return origin


def adapters_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, what: str) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable weights alone: its own class and hyperparameters, its own group dicts
    (an LR scheduler made on it still reaches them), each adapter in the group of the weight it adapts."""
    if any(optimizer.state.values()):
        raise DtypelabError(f"{what} trains adapters in place of the weights: its optimizer is rebuilt before the "
                            f"first step, and this {type(optimizer).__name__} has stepped already")
    trainable = [p for p in model.parameters() if p.requires_grad]
    origin = _origins(model)
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    placed: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for p in trainable:
        placed[group_of.get(id(p), group_of.get(origin.get(id(p), -1), 0))].append(p)
    groups = []
    for group, params in zip(optimizer.param_groups, placed, strict=True):
        if params:
            group["params"] = params
            groups.append(group)
    takes = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())}
    try:
        return type(optimizer)(groups, **defaults)
    except (TypeError, ValueError) as exc:
        raise Unsupported(f"{what}: {type(optimizer).__name__} cannot be rebuilt over the adapters ({exc})") from None


# Fine-tuning: a frozen base, LoRA adapters through peft (--lora-rank, --lora-alpha, --lora-targets set them per
# command); a question of their own, named, not in a training sweep. lora-fp8 needs float8 matmuls; its emulation
# (float8 storage, bfloat16 matmuls) runs anywhere.
FINE_TUNING = {c.label: register(c.label, c, sweeps=frozenset({"cpu-infer", "gpu-infer"}), rank=25 + i).name
               for i, c in enumerate((LoRA("bfloat16"), LoRA("float32"), LoRA("nf4"), LoRA("int8"), LoRA("fp8"),
                                      LoRA("fp8", emulate=True), LoRA("bfloat16", adapters="bfloat16"),
                                      LoRA("nf4", adapters="bfloat16")))}
for _name, _rank in (("lora-bf16", 3), ("lora-bf16+ckpt", 4), ("qlora-nf4", 5), ("qlora-nf4+ckpt", 6),
                     ("lora-int8+ckpt", 7), ("lora-fp8+ckpt", 8)):
    in_default("forecast-fine-tuning", _name, _rank)


__all__ = ["BASES", "FINE_TUNING", "Layout", "LoRA", "adapters_optimizer", "output_head", "peft_missing"]
