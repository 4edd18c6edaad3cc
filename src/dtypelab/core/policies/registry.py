"""The registry: every policy by name (a registered policy is a named plan), the modifiers a name takes (the
optimizer state's, the KV cache's), the default sweeps and lists each policy is in, and the lookup of a name, a
plan file or a user's ``FILE.py:NAME``. Nothing is registered here: each kind's module (``kinds/``) registers its
own policies and says which defaults hold them, a user's file its own. A parameterised variant is one line in its
kind's file::

    register("amp-fp16-noscaler", Autocast("float16", scaler=False))
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from typing import Any

from dtypelab.core.errors import DtypelabError
from dtypelab.core.policies.configs import Config, Emulable
from dtypelab.core.policies.distributed import split_modifier
from dtypelab.core.policies.loss import is_loss_label
from dtypelab.core.policies.plan import Plan, single
from dtypelab.core.policies.plugins import lookup
from dtypelab.core.results.store import read_json

REGISTRY: dict[str, Plan] = {}
# policies a user's file registered as it was loaded for FILE.py:NAME: they run when named, never in a default sweep
NAMED_ONLY: set[str] = set()
# Which default sweeps run a policy (bench's: a CPU's or a GPU's, training or inference), as each kind's module said
# when it registered it; by name only: none of them
EVERY_SWEEP = frozenset({"cpu-train", "cpu-infer", "gpu-train", "gpu-infer"})
SWEEPS: dict[str, frozenset[str]] = {}
# The default lists other commands start from (forecast's and serving's), each entry a policy as named (modifiers
# included: bf16-sr+adam8bit, int4-wo+kv-fp8) and its place in the list, as the kinds' modules add them
DEFAULTS: dict[str, list[tuple[float, str]]] = {}
_RANKS: dict[str, float] = {}  # a built-in's place in the listings (its kind's module says), whatever imports first
STATE_MODIFIERS: dict[str, Config] = {}  # POLICY+adam8bit: the optimizer-state kinds by label
KV_FORMATS: dict[str, Any] = {}  # POLICY+kv-fp8 (--mode generate): the KV-cache formats by label
EMULATED_BY: dict[str, str] = {}  # a GPU format's policy -> the policy that emulates its numerics (int4-wo-emu)


def register(name: str, policy: Config | Plan, summary: str = "", *, replace: bool = False,
             sweeps: frozenset[str] = EVERY_SWEEP, rank: float | None = None) -> Plan:
    """Register ``policy`` under ``name`` (its summary defaults to the config's own description); ``sweeps``: the
    default sweeps that run it (``EVERY_SWEEP``; ``frozenset()``: by name only); ``rank``: a built-in's place in
    the listings."""
    if name in REGISTRY and not replace:
        raise DtypelabError(f"policy {name!r} is registered already (replace=True overrides it)")
    plan = policy if isinstance(policy, Plan) else single(policy)
    plan = Plan(plan.default, plan.rules, name=name, summary=summary or plan.summary, compile=plan.compile)
    REGISTRY[name] = plan
    SWEEPS[name] = sweeps
    if rank is not None:
        _RANKS[name] = rank
    return plan


def in_default(listing: str, name: str, rank: float) -> None:
    """Put the policy ``name`` (modifiers included) in the default list ``listing`` at ``rank``."""
    DEFAULTS.setdefault(listing, []).append((rank, name))


def defaults(listing: str) -> tuple[str, ...]:
    """A default list, in its entries' order."""
    return tuple(name for _, name in sorted(DEFAULTS.get(listing, [])))


def register_state_modifier(config: Config) -> None:
    """An optimizer-state kind, named as a modifier: POLICY+LABEL."""
    STATE_MODIFIERS[config.label] = config


def register_emulation(real: str, emulated: str) -> None:
    """``emulated`` (a registered policy) runs the numerics of ``real`` where ``real``'s kernels are missing."""
    EMULATED_BY[real] = emulated


def register_kv(fmt: Any) -> None:
    """A KV-cache format (``kinds.kv_cache.KVFormat``), named as a modifier under --mode generate: POLICY+LABEL."""
    KV_FORMATS[fmt.label] = fmt


def order_builtins() -> None:
    """The built-ins in their ranks' order (each kind's module registers its own, in whatever order they import);
    the policies registered since (a user's) after them."""
    ranked = sorted((n for n in REGISTRY if n in _RANKS), key=_RANKS.__getitem__)
    rest = [n for n in REGISTRY if n not in _RANKS]
    ordered = {n: REGISTRY[n] for n in (*ranked, *rest)}
    REGISTRY.clear()
    REGISTRY.update(ordered)


def split_kv(spec: str) -> tuple[str, Any]:
    """``NAME[+kv-FORMAT]`` as (the weight format with its other modifiers, the KV format or None): the KV modifier
    anywhere among the others."""
    parts = spec.strip().split("+")
    kvs = [part for part in parts if part.startswith("kv-")]
    if len(kvs) > 1:
        raise DtypelabError(f"policy {spec}: one KV-cache format at most ({' and '.join('+' + k for k in kvs)} given)")
    if kvs and kvs[0] not in KV_FORMATS:
        raise DtypelabError(f"policy {spec}: unknown KV-cache format {kvs[0]!r}; use one of {', '.join(KV_FORMATS)}")
    head = "+".join(part for part in parts if not part.startswith("kv-"))
    return head, KV_FORMATS[kvs[0]] if kvs else None


def policies_for(mode: str) -> list[str]:
    """Every registered policy that can run in ``mode`` (train or infer), in registry order."""
    return [name for name, plan in REGISTRY.items() if mode in plan.modes]


def default_policies(mode: str, device: str = "cuda") -> list[str]:
    """What ``bench`` runs when no policy is named: ``policies_for(mode)`` that their kinds put in this device's
    default sweep for ``mode`` (``SWEEPS``), less what a user's file registered (``NAMED_ONLY``), and on a CPU
    (``device``) less the GPU-only ones."""
    cpu = device.startswith("cpu")
    sweep = f"{'cpu' if cpu else 'gpu'}-{mode}"
    return [name for name in policies_for(mode) if (sweep in SWEEPS.get(name, EVERY_SWEEP) or sweep not in EVERY_SWEEP)
            and name not in NAMED_ONLY and not (cpu and REGISTRY[name].gpu_only)]


def emulated_version(plan: Plan) -> Plan | None:
    """The emulated counterpart of a plan in a GPU format (float8 training, MX: the same recipe and layer filter,
    numerics only), or None when it has none: its kind has an ``emulate`` field, and it is off."""
    config = plan.default
    if plan.rules or plan.distributed or not isinstance(config, Emulable) or config.emulate or \
            not config.facts.gpu_only:
        return None
    emulated = dataclasses.replace(config, emulate=True)
    base = REGISTRY.get(emulated.label) or single(emulated)
    base = base.with_checkpoint() if plan.checkpoint else base
    base = base.with_loss(plan.loss) if plan.loss else base
    return base.with_state(plan.state) if plan.state is not None else base


def numerics_twin(plan: Plan) -> Plan | None:
    """What runs a GPU format's numerics here: the policy registered as its emulation (``int4-wo-emu``: the format's
    values, dequantized; not its stored layout, which ``emulated_version`` keeps), else its emulated version."""
    if plan.name in EMULATED_BY and not plan.rules and plan.distributed is None:
        return REGISTRY[EMULATED_BY[plan.name]]
    return emulated_version(plan)


def gpu_only_policies(mode: str) -> list[str]:
    """The registered policies for ``mode`` that have no CPU path: what a CPU run's default sweep leaves out."""
    return [name for name in policies_for(mode) if REGISTRY[name].gpu_only]


def _lookup(name: str) -> Plan:
    """A registered name, or NAME+compile: that policy under torch.compile."""
    if name not in REGISTRY and name.endswith("+compile") and name.removesuffix("+compile") in REGISTRY:
        return REGISTRY[name.removesuffix("+compile")].compiled()
    try:
        return REGISTRY[name]
    except KeyError:
        raise DtypelabError(unknown_policy(name)) from None


def modifiers_text() -> str:
    """The modifiers a policy takes, in the words of one line (``dtypelab policies`` lists them too)."""
    return (f"+compile, +ckpt, +chunked-ce or +chunked-ceN (the loss in N chunks), "
            f"+{'/+'.join(STATE_MODIFIERS)} (Adam's state), +ddp-*/+fsdp* (distributed), and with --mode generate "
            "+kv-FORMAT (the KV cache's format)")


def unknown_policy(name: str) -> str:
    """Why ``name`` names no policy, in one line: a modifier it does not know (whatever the order), a KV-cache format
    outside --mode generate, or the nearest policy's name."""
    head, _, tail = name.rpartition("+")
    if tail.startswith("kv-") or name.startswith("kv-"):
        kv = tail if tail.startswith("kv-") else name
        return (f"{kv!r} is a KV-cache format: it modifies a weight format under --mode generate "
                f"({head or 'bf16'}+{kv} --mode generate)")
    if head:
        known = head in REGISTRY or head.removesuffix("+compile") in REGISTRY
        return (f"policy {name!r}: unknown modifier '+{tail}'" + ("" if known else f" (and {head!r} is no policy)")
                + f"; modifiers: {modifiers_text()}")
    close = difflib.get_close_matches(name, REGISTRY, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return (f"unknown policy {name!r}{hint}: `dtypelab policies` lists them; also a plan file (.json) or your own "
            "precision file (FILE.py:NAME)")


def _config_named(name: str) -> Config:
    if name in STATE_MODIFIERS:  # a plan file's "state": "adam8bit"
        return STATE_MODIFIERS[name]
    plan = _lookup(name)
    if plan.rules:
        raise DtypelabError(f"policy {name!r} is a per-module plan; a plan's configs must be single policies")
    return plan.default


def load_plan(path: str) -> Plan:
    """A plan from a JSON file (see ``Plan.from_dict``); its name defaults to the file's stem."""
    data = read_json(path, "plan file")
    try:
        plan = Plan.from_dict(data, lookup=_config_named)
    except DtypelabError as exc:
        raise DtypelabError(f"{path}: {exc}") from None
    return plan if data.get("name") else dataclasses.replace(plan, name=os.path.splitext(os.path.basename(path))[0])


def plan_from_dict(d: dict[str, Any], *, load_source: bool = False) -> Plan:
    """A plan from ``Plan.to_dict()`` (a job handed to another process, a record), names resolved here;
    ``load_source`` only for a plan this run built (see ``config_from_dict``)."""
    return Plan.from_dict(d, lookup=_config_named, load_source=load_source)


def get_policy(spec: str | Config | Plan) -> Plan:
    """A registered name, a plan file (``*.json``), a user's ``FILE.py:NAME``, a config or a plan, as a plan."""
    if isinstance(spec, Plan):
        return spec
    if isinstance(spec, Config):
        return single(spec)
    base, modifier = split_modifier(str(spec))
    if modifier is not None:  # POLICY+ddp-fp16, plan.json+fsdp: the policy with a distributed modifier
        return get_policy(base).with_distributed(modifier)
    head, _, tail = str(spec).rpartition("+")
    if head and tail == "ckpt":  # POLICY+ckpt: that policy with its repeated blocks checkpointed
        plan = get_policy(head)
        if plan.checkpoint:
            raise DtypelabError(f"policy {spec}: +ckpt is given twice ({plan.name} checkpoints its blocks already)")
        return plan.with_checkpoint()
    if head and is_loss_label(tail):  # POLICY+chunked-ce: that policy with its loss computed in chunks
        return get_policy(head).with_loss(tail)
    if head and tail in STATE_MODIFIERS:  # POLICY+adam8bit: that policy with its Adam state in 8 bits
        return get_policy(head).with_state(STATE_MODIFIERS[tail])
    if head and tail == "compile" and head not in REGISTRY:  # POLICY+ckpt+compile: any order of the modifiers
        plan = get_policy(head)
        if plan.compiles:
            raise DtypelabError(f"policy {spec}: +compile is given twice")
        return plan.compiled()
    if isinstance(spec, str) and spec.endswith(".json"):
        return load_plan(spec)
    if ":" in str(spec):  # a user's file: my_precision.py:NAME, or pkg.module:NAME
        before = set(REGISTRY)
        plan = lookup(str(spec), REGISTRY)
        NAMED_ONLY.update(set(REGISTRY) - before)
        return plan
    return _lookup(str(spec))


def baseline_policy(spec: str) -> Plan:
    """``--baseline``'s policy, its errors saying which option they are about."""
    try:
        return get_policy(spec)
    except DtypelabError as exc:
        raise DtypelabError(f"--baseline: {exc}") from None


def _names_file(spec: str) -> bool:
    """``FILE.py:NAME`` or ``pkg.module:NAME`` (with any modifier): a spec that imports code the user named."""
    return ":" in spec and ".json" not in spec


def parse_policies(policies: str | Sequence[str | Config | Plan] | None) -> list[Plan]:
    """'fp32,bf16,plan.json' or a list of names / configs / plans -> plans, validated and without repeats;
    None -> every registered policy."""
    if policies is None:
        return list(REGISTRY.values())
    items = [n.strip() for n in policies.split(",") if n.strip()] if isinstance(policies, str) else list(policies)
    if not items:
        raise DtypelabError("--policies is empty: give names such as fp32,amp-bf16")
    # the files the user named first, so that a plan file naming one of their kinds reads in any order
    looked_up = {id(item): get_policy(item) for item in items if isinstance(item, str) and _names_file(item)}
    plans = {}
    for item in items:
        plan = looked_up.get(id(item)) or get_policy(item)
        if plan.name in plans and plans[plan.name] != plan:
            raise DtypelabError(f"two different policies are called {plan.name!r}: give the plan a 'name'")
        plans[plan.name] = plan
    return list(plans.values())


