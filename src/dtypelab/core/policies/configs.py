"""The base of every precision kind: a frozen, parameterised config (torchao's shape) whose methods are the hooks that
say what the kind does to a model (Lightning Fabric's precision-plugin shape). ``precision.Precision`` combines the
kinds of a plan, region by region, and calls these hooks; nothing else asks which kind a config is.

A kind is one module: a ``Config`` subclass with a ``kind`` name (it registers itself when defined) and the hooks it
needs; the defaults below do nothing. The built-in kinds are in ``kinds/`` (cast, tf32, autocast, quantize,
float8); ``examples/custom_precision.py`` is one of a user's own.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from dtypelab.core.errors import DtypelabError
from dtypelab.core.footprint import ActivationPart as ActivationPart  # a kind's hook returns them
from dtypelab.core.machine.hardware import HardwareInfo

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
T = TypeVar("T")
SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _float_dtype(name: str, what: str) -> str:
    canonical = {v: k for k, v in SHORT.items()}.get(name, name)
    if canonical not in FLOAT_DTYPES:
        raise DtypelabError(f"{what}: unknown dtype {name!r}; use one of {', '.join(FLOAT_DTYPES)}")
    return canonical


def bf16_missing(hw: HardwareInfo, what: str) -> str | None:
    """Why bfloat16 cannot run here (pre-Ampere GPU), or None. CPUs emulate it; the probe judges speed."""
    if hw.is_cuda and hw.native("bfloat16") is False:
        cc = ".".join(map(str, hw.cuda_capability)) if hw.cuda_capability else "older"
        return f"{what} needs compute capability >= 8.0 (this GPU is {cc})"
    return None


def source_of(module_name: str) -> str | None:
    """What imports the module a kind was defined in again, in another process: its file for a user's file or for
    the script being run (when its own work is under ``if __name__ == "__main__":``, as multiprocessing also needs),
    its name for an importable module; None for dtypelab's own."""
    if module_name.startswith("dtypelab."):
        return None
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if module_name == "__main__":
        return os.path.abspath(path) if path and _guarded(path) else None
    return os.path.abspath(path) if module_name.startswith("dtypelab_user_") and path else module_name


def _guarded(path: str) -> bool:
    """Whether a script keeps its work under ``if __name__ == "__main__":`` (importing it then only defines)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) and "__main__" in ast.unparse(n.test)
               for n in tree.body)


@dataclass(frozen=True)
class Facts:
    """What a kind is, as data (torchao's shape: a config is data, its behaviour the hooks): one frozen record that
    the capabilities read, so that the kind's class holds fields and hooks only. A kind whose facts depend on its
    fields builds its record from them (``Config.facts``)."""

    modes: tuple[str, ...] = ("train", "infer")
    compute_dtype: str = "float32"  # what the matmuls run in: the hardware probe's throughput key
    storage_dtype: str = "float32"  # what the model's floats (and its inputs) are cast to
    autocast_dtype: str | None = None  # the forward's autocast dtype, when the config runs one
    scales_loss: bool = False  # the backward runs through a GradScaler
    backend: str = "torch"
    arithmetic: str = ""  # for formats that need saying: what the hardware really computes in
    # the hardware probe's throughput entry that decides whether this config is pathologically slow here: the
    # kernel a quantized config runs ("": its compute dtype)
    probe: str = ""
    emulated: bool = False  # stored in the format, computed in a wider one: its speed is not its own
    # the numerics of a format this hardware cannot run (float8 training emulated): no speed verdict, never chosen
    # for speed, only said to keep the metric or not
    numerics_only: bool = False
    speed_needs: str = ""  # numerics_only: the hardware its speed needs, in words
    # numerics_only here, but its GPU kernel is the forecasts' (a weight format emulated in float: w4a16-gptq runs
    # vLLM's Marlin there): a forecast times it by that kernel
    gpu_kernel: bool = False
    compiles: bool = False
    always_compiles: bool = False  # compiling is part of the kind (torchao's float8), not a plan's choice
    # a GPU format with no CPU path at all: a CPU run's default sweep leaves it out (tf32 stays in: it is the
    # first question on a GPU, and its one skipped row says where it runs)
    gpu_only: bool = False
    # low-precision weights whose small updates the kind keeps anyway (a master copy, compensation, stochastic
    # rounding): a bench run does not count the updates its weights lose
    keeps_updates: bool = False
    process_wide: bool = False  # a process-wide setting (tf32): only a plan's default, alone
    # a whole-model program run by its own runtime (ExecuTorch's .pte): measured by bench --mode infer and written by
    # export; the capabilities that trace eager PyTorch or serve a language model through its cache refuse it
    program: str = ""

    @property
    def probe_key(self) -> str:
        """The probe's throughput entry for this config: its kernel, or its compute dtype."""
        return self.probe or self.compute_dtype


PLAIN = Facts()

# the names a kind written before Facts gave its facts (the probe's entry was ``probe_key``)
FACT_NAMES = (*(f.name for f in fields(Facts) if f.name != "probe"), "probe_key")


@dataclass(frozen=True)
class Config:
    """One way to run a module's numerics. Subclasses are frozen dataclasses; ``kind`` names them in JSON; what the
    kind is lives in one ``Facts`` record (``facts``), what it does in the hooks below."""

    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _fold_legacy_facts(cls)
        _cache_facts(cls)
        if "kind" in cls.__dict__:
            _register(cls)

    @property
    def facts(self) -> Facts:
        """What this config is (the default: float32, both modes, plain torch)."""
        return PLAIN

    @property
    def label(self) -> str:
        """A short name for a config that is not registered under one."""
        return self.kind

    def describe(self) -> str:
        """One line for the table and the record: what this config does to the model."""
        return f"{self.label} ({type(self).__name__})"

    def supported(self, hw: HardwareInfo) -> str | None:
        """Why this config cannot run on this hardware at all, or None when it can."""
        return None

    def plan_error(self, plan: Any) -> str | None:
        """Why ``plan`` (a ``Plan``), which holds this config, has no meaning (before any model is built), or None."""
        return None

    # --- the hooks Precision calls -------------------------------------------------------------------
    def session(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Process-wide state for the whole run (tf32's flags), restored afterwards."""
        return contextlib.nullcontext()

    def region(self, parent: Config, outer: torch.dtype) -> Config | None:
        """How a module given this config, inside one running ``parent`` (the model computing in ``outer``), runs:
        the config whose ``storage_dtype`` and ``autocast_dtype`` its region takes, or None for no region (it runs
        as its neighbours do)."""
        return self

    def region_context(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The autocast state inside a region of this config."""
        dtype = self.facts.autocast_dtype
        if dtype is not None:
            return torch.autocast(device_type, dtype=getattr(torch, dtype))
        return torch.autocast(device_type, enabled=False)

    def convert_module(self, model: nn.Module, names: list[str]) -> tuple[nn.Module, dict[str, Any]]:
        """The model with the modules called ``names`` (those this config covers) converted, and what the record
        should say of it (``format``, ``converted``, ``left_out``), after the casts and regions."""
        return model, {}

    def leaves(self, model: nn.Module) -> set[str]:
        """The modules it covers but leaves as they are whatever their shape (a weight format's output head, as
        llm-compressor's recipes leave it): the forecasts count and time them unconverted."""
        return set()

    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The context of the forward pass and the loss, when this config is the plan's default."""
        dtype = self.facts.autocast_dtype
        if dtype is not None:
            return torch.autocast(device_type, dtype=getattr(torch, dtype))
        return contextlib.nullcontext()

    def convert_output(self, output: Any) -> Any:
        """A script model's outputs, before the script's own loss (outside the forward context)."""
        return output

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the model trains with: the task's or script's own, converted or replaced (once, before the
        first step)."""
        return optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """One optimizer step: ``step()`` runs it (through the GradScaler under a scaling policy); a kind that keeps
        its own state around the step (a master copy) wraps it."""
        return step()

    def master_tensors(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors this kind keeps beside the weights to hold their exact values (a float32 master copy, Kahan's
        compensation): what the memory breakdown counts as ``master_weights`` rather than optimizer state."""
        return []

    def activation_parts(self, model: nn.Module) -> list[ActivationPart]:
        """Modules whose saved activations the memory breakdown counts apart, each part labelled (LoRA's adapters:
        what they keep of their inputs); the record and the table take them as they come."""
        return []

    def __reduce__(self) -> Any:
        if SOURCES.get(self.kind):  # a user's kind pickles as its JSON: unpickling imports its file first
            return (_unpickled, (config_to_dict(self),))
        return super().__reduce__()


def _fold_legacy_facts(cls: type[Config]) -> None:
    """A user's kind written before ``Facts`` (its facts as class attributes or properties: ``compute_dtype =
    "bfloat16"``) keeps working: its ``facts`` are its parent's with those values read from the config."""
    own = []  # the classes below the nearest one that states its facts
    for k in cls.__mro__:
        if "facts" in k.__dict__:
            break
        own.append(k)
    names = tuple(n for n in FACT_NAMES if any(n in k.__dict__ for k in own))
    if not names:
        return
    inherited = cls.facts

    def facts(self: Config) -> Facts:
        assert isinstance(inherited, property) and inherited.fget is not None
        return replace(inherited.fget(self), **{("probe" if n == "probe_key" else n): getattr(self, n) for n in names})

    cls.facts = property(facts)  # type: ignore[method-assign,assignment]


def _cache_facts(cls: type[Config]) -> None:
    """A kind's ``facts``, built once per config: a config is frozen, and a region's forward reads them on every call.
    Kept in the instance under the defining class's name (a subclass's facts may start from its base's)."""
    prop = cls.__dict__.get("facts")
    if not isinstance(prop, property) or prop.fget is None:
        return
    compute, key = prop.fget, f"{cls.__module__}.{cls.__qualname__}"

    def facts(self: Config) -> Facts:
        cache = self.__dict__.setdefault("_facts_built", {})  # the instance's own dict: frozen fields untouched
        if key not in cache:
            cache[key] = compute(self)
        result: Facts = cache[key]
        return result

    cls.facts = property(facts, doc=prop.__doc__)  # type: ignore[method-assign,assignment]


class Emulable:
    """A kind whose format needs a GPU, with an ``emulate`` field (a dataclass field of the kind itself): off, the
    real kernels, on the GPU alone; on, torchao's emulated numerics, anywhere, for the numerics only (no speed).
    ``needs`` says which GPU its speed needs."""

    emulate: bool
    needs: ClassVar[str] = "a GPU"

    def emulable(self, facts: Facts) -> Facts:
        """``facts`` with what emulating changes: GPU-only off, emulated and numerics-only on, what speed needs."""
        return replace(facts, gpu_only=not self.emulate, emulated=self.emulate, numerics_only=self.emulate,
                       speed_needs=self.needs if self.emulate else "")


# --- the registry and the JSON, outside the class (torchao's shape: a config is data) -------------------------------
KINDS: dict[str, type[Config]] = {}  # every kind by its JSON name, filled as subclasses are defined
SOURCES: dict[str, str] = {}  # a user's kind: the file or module that defines it (see plugins.py)
_loader: Callable[[str], Any] | None = None  # plugins.load_source, once plugins is imported


def _register(cls: type[Config]) -> None:
    known = KINDS.get(cls.kind)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise DtypelabError(f"precision kind {cls.kind!r} is defined twice ({known.__module__}."
                            f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__})")
    KINDS[cls.kind] = cls  # a module loaded again (a file named twice) redefines its own kind
    source = source_of(cls.__module__)
    if source:
        SOURCES[cls.kind] = source


def set_source_loader(load: Callable[[str], Any]) -> None:
    """How ``config_from_dict`` imports a user's kind's file (plugins.load_source: plugins sits above this module)."""
    global _loader
    _loader = load


def config_to_dict(config: Config) -> dict[str, Any]:
    """A config's JSON: its kind's name, its fields, and the file that defines a user's kind."""
    source = SOURCES.get(config.kind)
    return {"kind": config.kind, **asdict(config), **({"source": source} if source else {})}


def config_from_dict(d: dict[str, Any], *, load_source: bool = False) -> Config:
    """A config from ``config_to_dict``'s shape. A user's kind names the file that defines it (``source``); that file
    is imported only with ``load_source`` (a job this run built, handed to its own worker), never for a file read from
    disk: a plan, record or exported model is data, and reading one runs no code."""
    d = dict(d)  # the package imports every built-in kind before any lookup
    name, source = d.pop("kind", None), d.pop("source", None)
    if name not in KINDS and source:
        if not load_source or _loader is None:
            raise DtypelabError(
                f"precision kind {name!r} is defined in {source}, which dtypelab does not import because a file "
                f"names it (reading a file never runs code): name it yourself, e.g. --policies {source}:NAME")
        _loader(source)  # a user's kind, in a worker that has not loaded its file yet
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise DtypelabError(f"unknown config kind {name!r} in {d!r}: use one of {', '.join(KINDS)}, or load "
                            "the file that defines it (--policies FILE.py:NAME)")
    return from_fields(kind, d, f"{kind.kind} config")


def _unpickled(d: dict[str, Any]) -> Config:
    """Unpickling a user's kind (``__reduce__``): a pickle is code already, sent by this run to its own worker."""
    return config_from_dict(d, load_source=True)


def from_fields(cls: type[T], d: dict[str, Any], what: str) -> T:
    """``cls(**d)``, with a one-line error naming any field ``cls`` does not have."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise DtypelabError(f"{what}: unknown field(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(sorted(known)) or 'none'}")
    return cls(**d)


def cuda_missing(hw: HardwareInfo, what: str, floor: tuple[int, int]) -> str | None:
    """Why a CUDA-only format cannot run here (the CPU, or a GPU below compute capability ``floor``), or None."""
    need = f"CUDA compute capability >= {floor[0]}.{floor[1]}"
    if not hw.is_cuda:
        return f"{what} needs {need}; this run is on the CPU"
    if hw.cuda_capability is not None and tuple(hw.cuda_capability) < floor:
        cc = ".".join(map(str, hw.cuda_capability))
        return f"{what} needs {need} (this GPU, {hw.device_name}, is {cc})"
    return None
