"""A plan: which precision config each module of a model runs in (torchao's ``FqnToConfig`` shape).

``Plan(default, rules)``: ``rules`` is an ordered mapping from a module-name pattern to a config. A pattern
is an exact module name (``classifier``, ``encoder.layer.0.attention.output.dense``), a glob
(``*.attention.output.dense``) or a regular expression prefixed ``re:`` (matched against the whole name).
Exact names win over patterns; among patterns the first that matches wins; a module no rule names takes
its parent's config, and the root takes ``default``. Every registered policy is a plan without rules.

Plans are frozen and picklable (they travel to child processes) and save as versioned JSON, where a config
may be written out (``{"kind": "cast", "dtype": "float32"}``) or named by a registered policy (``"fp32"``).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

from dtypelab.core.errors import DtypelabError
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies.configs import Config, config_from_dict, config_to_dict
from dtypelab.core.policies.distributed import Distributed
from dtypelab.core.policies.loss import loss_choice

PLAN_SCHEMA = "dtypelab.plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class Availability:
    """Whether a plan can run here; ``slow`` means it can but was measured pathologically slow."""

    ok: bool
    reason: str = ""
    slow: bool = False


def _matches(pattern: str, name: str) -> bool:
    """Whether a rule's pattern names a module: ``re:`` regex (whole name), glob, or the exact name. The re
    and fnmatch modules cache compiled patterns, so nothing is kept on the plan."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern


@dataclass(frozen=True)
class Plan:
    """``default`` for the whole model, ``rules`` ((pattern, config), ...) for the modules they name."""

    default: Config
    rules: tuple[tuple[str, Config], ...] = ()
    name: str = ""
    summary: str = ""
    compile: bool = False  # run the whole model under torch.compile (a quantize config may also ask for it)
    distributed: Distributed | None = None  # with --nproc: DDP hook / FSDP mixed precision (``+ddp-fp16``)
    state: Config | None = None  # the optimizer state's own format (``+adam8bit``): a kind that converts the optimizer
    checkpoint: bool = False  # ``+ckpt``: each repeated block recomputed in the backward (``checkpointing``)
    loss: str = ""  # ``+chunked-ce``: the loss computed the way it names (``loss``); "": the task's own

    def __post_init__(self) -> None:
        rules = tuple((str(p), c) for p, c in (self.rules.items() if isinstance(self.rules, Mapping) else self.rules))
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "name", self.name or self._derived_name())
        self._check()

    def _derived_name(self) -> str:
        tail = "+compile" if self.compile and not any(c.facts.compiles for c in self.configs) else ""
        tail += "+ckpt" if self.checkpoint else ""
        tail += f"+{self.loss}" if self.loss else ""
        tail += f"+{self.state.label}" if self.state is not None else ""
        tail += f"+{self.distributed.label}" if self.distributed is not None else ""
        if not self.rules:
            return self.default.label + tail
        return f"{self.default.label}+" + ",".join(f"{p}={c.label}" for p, c in self.rules) + tail

    def _check(self) -> None:
        """Refuse combinations that have no meaning, before any model is built."""
        if not any(all(m in c.facts.modes for c in self.configs) for m in ("train", "infer")):
            raise DtypelabError(f"plan {self.name}: its configs share no mode (" + "; ".join(
                f"{c.label}: {'/'.join(c.facts.modes)}" for c in self.configs) + ")")
        for pattern, config in self.rules:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise DtypelabError(f"plan pattern {pattern!r} is not a valid regular expression: {exc}") from None
            if config.facts.process_wide or (self.default.facts.process_wide and config != self.default):
                wide = config if config.facts.process_wide else self.default
                raise DtypelabError(f"plan {self.name}: {wide.label}"
                                    " is a process-wide setting; it can only be the plan's default, alone (rule "
                                    f"{pattern!r})")
        for config in self.configs:
            why = config.plan_error(self)
            if why:
                raise DtypelabError(f"plan {self.name}: {why}")
        if self.checkpoint and "train" not in self.modes:
            raise DtypelabError(f"plan {self.name}: +ckpt recomputes activations in the backward; it is for training, "
                                "and this plan is inference-only")
        if self.distributed is not None and "train" not in self.modes:
            raise DtypelabError(f"plan {self.name}: distributed modifiers are for training; quantized plans are "
                                "inference-only")
        if self.loss:
            loss_choice(self.loss)  # a name it does not know is one line
            if "train" not in self.modes:
                raise DtypelabError(f"plan {self.name}: +{self.loss} is how the training loss is computed, and this "
                                    "plan is inference-only")

    # --- what the plan holds ----------------------------------------------------------------------
    @property
    def configs(self) -> tuple[Config, ...]:
        """Every distinct config, the default first (the optimizer-state modifier last: its hook sees the optimizer
        the module configs made)."""
        state = [self.state] if self.state is not None else []
        return tuple(dict.fromkeys([self.default, *(c for _, c in self.rules), *state]))

    @property
    def modes(self) -> tuple[str, ...]:
        modes = tuple(m for m in ("train", "infer") if all(m in c.facts.modes for c in self.configs))
        only_train = self.distributed is not None or self.checkpoint or self.loss
        return tuple(m for m in modes if m == "train") if only_train else modes

    @property
    def gpu_only(self) -> bool:
        """Some config has no CPU path (fp8 training, fp8 dynamic, int4): a CPU sweep leaves the plan out unless
        it is named."""
        return any(c.facts.gpu_only for c in self.configs)

    @property
    def uses_scaler(self) -> bool:
        return any(c.facts.scales_loss for c in self.configs)

    @property
    def compiles(self) -> bool:
        return self.compile or any(c.facts.compiles for c in self.configs)

    @property
    def emulated(self) -> bool:
        return any(c.facts.emulated for c in self.configs)

    @property
    def numerics_only(self) -> bool:
        """Some config only emulates its format's numerics here: the run says nothing of speed."""
        return any(c.facts.numerics_only for c in self.configs)

    @property
    def program(self) -> str:
        """The runtime of a whole-model program this plan is (an ExecuTorch .pte), or "" for a PyTorch model."""
        return next((c.facts.program for c in self.configs if c.facts.program), "")

    @property
    def compute_dtype(self) -> str:
        return self.default.facts.compute_dtype

    def describe(self) -> str:
        if self.summary:  # a registered policy's words; its modifiers said after them
            text = self.summary
        else:
            text = self.default.describe()
            if self.rules:
                text += "; " + "; ".join(f"{p}: {c.label}" for p, c in self.rules)
            if self.compile and not any(c.facts.compiles for c in self.configs):
                text += ", under torch.compile (the first call compiles)"
        if self.checkpoint:
            text += "; activations checkpointed per repeated block (recomputed in the backward)"
        if self.loss:
            text += f"; the loss's {loss_choice(self.loss).describe()}"
        if self.state is not None:
            text += f"; {self.state.describe()}"
        if self.distributed is not None:
            text += f"; {self.distributed.describe()}"
        return text

    def compiled(self) -> Plan:
        """This plan under torch.compile, named NAME+compile (a quantize config compiles itself)."""
        if self.compiles:
            return self
        # a kind with a compile field of its own (quantize) compiles itself
        swap = {c: replace(c, compile=True) for c in self.configs if "compile" in {f.name for f in fields(c)}}
        if swap:
            return Plan(swap.get(self.default, self.default), tuple((p, swap.get(c, c)) for p, c in self.rules),
                        name=f"{self.name}+compile", distributed=self.distributed, state=self.state,
                        checkpoint=self.checkpoint, loss=self.loss)
        return Plan(self.default, self.rules, name=f"{self.name}+compile", compile=True, distributed=self.distributed,
                    state=self.state, checkpoint=self.checkpoint, loss=self.loss)

    def with_checkpoint(self) -> Plan:
        """This plan with its repeated blocks checkpointed, named NAME+ckpt (before any state or distributed
        modifier)."""
        if self.checkpoint:
            return self
        return replace(self, checkpoint=True, name=self._named_with("ckpt"))

    def with_loss(self, label: str) -> Plan:
        """This plan with its loss computed as ``label`` says (``loss``), named NAME+LABEL (before any state or
        distributed modifier)."""
        if self.loss:
            raise DtypelabError(f"policy {self.name}+{label}: a loss is named twice ({self.name} computes its loss as "
                                f"{self.loss} already)")
        return replace(self, loss=label, name=self._named_with(label))

    def _named_with(self, modifier: str) -> str:
        """This plan's name with ``+modifier`` before its state and distributed modifiers, which the name ends with."""
        tail = (f"+{self.state.label}" if self.state else "") + (f"+{self.distributed.label}" if self.distributed
                                                                 else "")
        return f"{self.name.removesuffix(tail)}+{modifier}{tail}"

    def with_distributed(self, spec: Distributed | None) -> Plan:
        """This plan with a distributed modifier, named NAME+MODIFIER."""
        if spec is None or spec == self.distributed:
            return self
        base = self.name.removesuffix(f"+{self.distributed.label}") if self.distributed else self.name
        return replace(self, distributed=spec, name=f"{base}+{spec.label}")

    def with_state(self, state: Config) -> Plan:
        """This plan with the optimizer state in ``state``'s format, named NAME+LABEL (before any distributed
        modifier)."""
        if state == self.state:
            return self
        if self.state is not None:
            raise DtypelabError(f"plan {self.name} has an optimizer-state modifier already ({self.state.label})")
        return replace(self, state=state, name=self._named_with(state.label))

    def config_for(self, name: str, parent: Config | None = None) -> Config:
        """The config of the module called ``name`` whose parent runs in ``parent`` (None: the root)."""
        for pattern, config in self.rules:
            if pattern == name:
                return config
        for pattern, config in self.rules:
            if _matches(pattern, name):
                return config
        return self.default if parent is None else parent

    def assign(self, model: nn.Module) -> dict[str, Config]:
        """Every module's config, by name ('' is the root), in ``named_modules`` order."""
        out: dict[str, Config] = {}
        for name, _ in model.named_modules(remove_duplicate=False):
            parent = out.get(name.rpartition(".")[0]) if name else None
            out[name] = self.config_for(name, parent)
        unmatched = [p for p, _ in self.rules if not any(_matches(p, n) for n in out if n)]
        if unmatched:
            raise DtypelabError(f"plan {self.name}: no module matches {', '.join(map(repr, unmatched))} "
                                f"(modules: {', '.join(n for n in list(out)[1:8])}{', …' if len(out) > 8 else ''})")
        return out

    # --- where it runs ------------------------------------------------------------------------------
    def mode_error(self, mode: str) -> str | None:
        if mode in self.modes:
            return None
        if self.distributed is not None or self.modes == ("train",):
            kind = "distributed training" if self.distributed is not None else "training"
            return f"policy {self.name} is a {kind} policy: use --mode train"
        return f"policy {self.name} is inference-only (it quantizes a trained model): use --mode infer"

    def availability(self, hw: HardwareInfo) -> Availability:
        for config in self.configs:
            why_not = config.supported(hw)
            if why_not:
                return Availability(False, why_not)
        fsdp_dtype = self.distributed.compute_dtype if self.distributed is not None else None
        for key in [c.facts.probe_key for c in self.configs] + ([fsdp_dtype] if fsdp_dtype else []):
            slow = hw.slow_reason(key)
            if slow and not hw.disturbed:  # a disturbed probe skips nothing: the in-run check decides
                if self.compile or any(c.facts.compiles for c in self.configs):
                    slow += "; compiling does not change that"
                return Availability(True, slow, slow=True)
        return Availability(True)

    def require(self, hw: HardwareInfo, force: bool = False) -> None:
        """For single-policy commands (audit, trace): an error when the plan cannot run here, or when it was
        measured pathologically slow here (fp16 on a CPU without fp16 arithmetic) and not ``force``."""
        avail = self.availability(hw)
        if not avail.ok:
            raise DtypelabError(f"policy {self.name} cannot run here: {avail.reason}")
        if avail.slow and not force:
            raise DtypelabError(f"policy {self.name} is refused: {avail.reason}; --force runs it anyway")

    # --- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, "schema_version": PLAN_VERSION, "name": self.name, "summary": self.summary,
                "default": config_to_dict(self.default),
                "rules": [{"pattern": p, "config": config_to_dict(c)} for p, c in self.rules],
                **({"compile": True} if self.compile else {}),
                **({"checkpoint": True} if self.checkpoint else {}),
                **({"loss": self.loss} if self.loss else {}),
                **({"distributed": self.distributed.to_dict()} if self.distributed is not None else {}),
                **({"state": config_to_dict(self.state)} if self.state is not None else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any], lookup: Callable[[str], Config] | None = None, *,
                  load_source: bool = False) -> Plan:
        """From ``to_dict``'s shape. ``lookup`` turns a registered policy's name into its config, so plan files
        may say ``"default": "amp-bf16"`` and ``{"pattern": "head", "config": "fp32"}``. ``load_source``: see
        ``config_from_dict`` (only for a plan this run built)."""
        if d.get("schema", PLAN_SCHEMA) != PLAN_SCHEMA:
            raise DtypelabError(f"not a dtypelab plan (schema {d.get('schema')!r})")
        if d.get("schema_version", PLAN_VERSION) > PLAN_VERSION:
            raise DtypelabError(f"plan has schema version {d['schema_version']}; this dtypelab reads "
                                f"{PLAN_VERSION}")

        def config(x: Any) -> Config:
            if isinstance(x, str):
                if lookup is None:
                    raise DtypelabError(f"plan names policy {x!r}, but no registry was given to look it up")
                return lookup(x)
            if isinstance(x, dict):
                return config_from_dict(x, load_source=load_source)
            raise DtypelabError(f"a plan config must be a policy name or an object with a 'kind', not {x!r}")

        if "default" not in d:
            raise DtypelabError("a plan needs a 'default' config (a policy name such as 'fp32', or an object)")
        rules = d.get("rules", [])
        if isinstance(rules, dict):  # {"pattern": config, ...}: insertion order is the rule order
            rules = [{"pattern": p, "config": c} for p, c in rules.items()]
        try:
            pairs = tuple((r["pattern"], config(r["config"])) for r in rules)
        except (KeyError, TypeError):
            raise DtypelabError("plan rules must be objects with 'pattern' and 'config'") from None
        dist = d.get("distributed")
        if dist is not None and not isinstance(dist, dict):
            raise DtypelabError("a plan's 'distributed' must be an object such as {\"strategy\": \"ddp\", "
                                "\"hook\": \"fp16\"}")
        return cls(config(d["default"]), pairs, name=d.get("name", ""), summary=d.get("summary", ""),
                   compile=bool(d.get("compile", False)), checkpoint=bool(d.get("checkpoint", False)),
                   loss=str(d.get("loss") or ""),
                   distributed=Distributed.from_dict(dist) if dist is not None else None,
                   state=config(d["state"]) if d.get("state") is not None else None)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def single(config: Config, name: str = "", summary: str = "") -> Plan:
    """A whole-model plan: ``config`` everywhere."""
    return Plan(config, (), name=name, summary=summary)


__all__ = ["PLAN_SCHEMA", "Availability", "Plan", "single"]
