"""The registry: every policy by name (a registered policy is a named plan), the built-ins registered below, and
the lookup of a name, a plan file or a user's ``FILE.py:NAME``. Adding a parameterised variant is one line::

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
from dtypelab.core.policies.kinds import (
    TF32,
    Autocast,
    BF16Update,
    Cast,
    Float8Train,
    LoRA,
    LowBitState,
    MXInfer,
    MXTrain,
    Quantize,
)
from dtypelab.core.policies.loss import is_loss_label
from dtypelab.core.policies.plan import Plan, single
from dtypelab.core.policies.plugins import lookup
from dtypelab.core.results.store import read_json
from dtypelab.core.tolerance import BASELINE, COMPILED_BASELINE

REGISTRY: dict[str, Plan] = {}
# policies a user's file registered as it was loaded for FILE.py:NAME: they run when named, never in a default sweep
NAMED_ONLY: set[str] = set()


def register(name: str, policy: Config | Plan, summary: str = "", *, replace: bool = False) -> Plan:
    """Register ``policy`` under ``name`` (its summary defaults to the config's own description)."""
    if name in REGISTRY and not replace:
        raise DtypelabError(f"policy {name!r} is registered already (replace=True overrides it)")
    plan = policy if isinstance(policy, Plan) else single(policy)
    plan = Plan(plan.default, plan.rules, name=name, summary=summary or plan.summary, compile=plan.compile)
    REGISTRY[name] = plan
    return plan


register("fp64", Cast("float64"))
register(BASELINE, Cast("float32"))
register("tf32", TF32())
register("bf16", Cast("bfloat16"))
register("fp16", Cast("float16"))
register("amp-bf16", Autocast("bfloat16"), "torch.autocast(bfloat16) with float32 weights")
register("amp-fp16", Autocast("float16", scaler=True), "torch.autocast(float16) + GradScaler, float32 weights")
register("int8-dyn", Quantize("int8-dynamic"), "int8 weights (per channel) + int8 activations (per token), torchao, "
         "eager")
# Compiled float baselines: a compiled quantized policy is only fairly compared with compiled float ones.
register(COMPILED_BASELINE, REGISTRY["fp32"].compiled(), "float32 under torch.compile: the speed baseline of "
         "compiled policies")
register("bf16+compile", REGISTRY["bf16"].compiled())
register("amp-bf16+compile", REGISTRY["amp-bf16"].compiled(), "torch.autocast(bfloat16) with float32 weights, under "
         "torch.compile: the fair baseline of float8 training, which compiles")
register("int8-dyn-compile", Quantize("int8-dynamic", compile=True))
register("int8-wo", Quantize("int8-weight-only"))
register("fp8-wo", Quantize("fp8-weight-only"))
register("int8-dyn-legacy", Quantize("int8-dynamic", library="torch.ao", granularity="per-tensor"))
register("int8-dyn-legacy-pc", Quantize("int8-dynamic", library="torch.ao", granularity="per-channel"))
# GPU-native formats (CUDA only; a CPU sweep leaves them out unless named): float8 training on compute capability
# >= 8.9, real float8 inference matmuls there, int4 weight-only inference.
register("fp8-tensorwise", Float8Train("tensorwise"))
register("fp8-rowwise", Float8Train("rowwise"))
register("fp8-rowwise-gw-hp", Float8Train("rowwise_with_gw_hp"))
register("fp8-dyn-row", Quantize("fp8-dynamic"))
register("fp8-dyn-tensor", Quantize("fp8-dynamic", granularity="per-tensor"))
register("int4-wo", Quantize("int4-weight-only"))
# The training state: bfloat16 weights whose small updates survive, and (POLICY+adam8bit, a modifier of any policy
# that trains with Adam or AdamW) the optimizer's moments in fewer bits.
register("bf16-sr", BF16Update("stochastic-round"))
register("bf16-kahan", BF16Update("kahan"))
STATE_MODIFIERS = {c.label: c for c in (LowBitState("8bit"), LowBitState("4bit"), LowBitState("fp8"))}
# Fine-tuning: a frozen base, LoRA adapters through peft (--lora-rank, --lora-alpha, --lora-targets set them per
# command). lora-fp8 needs float8 matmuls; its emulation (float8 storage, bfloat16 matmuls) runs anywhere.
FINE_TUNING = {c.label: register(c.label, c).name for c in (
    LoRA("bfloat16"), LoRA("float32"), LoRA("nf4"), LoRA("int8"), LoRA("fp8"), LoRA("fp8", emulate=True),
    LoRA("bfloat16", adapters="bfloat16"), LoRA("nf4", adapters="bfloat16"))}
# The numerics of the GPU-only float8 training recipes where they cannot run (bench --emulate picks them): torchao's
# emulation, numerics only. Same layer filter as on the GPU; the -all variants convert every eligible layer.
# MX (Blackwell): mxfp8 training, mxfp8 / mxfp4 inference, and their emulated numerics.
register("mxfp8", MXTrain())
register("mxfp8-dyn", MXInfer("mxfp8"))
register("mxfp4-dyn", MXInfer("mxfp4"))
_GPU_FORMATS = [*(Float8Train(r, s) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp") for s in ("auto", "none")),
                MXTrain(), MXInfer("mxfp8"), MXInfer("mxfp4")]
EMULATED = {real.label: register(dataclasses.replace(real, emulate=True).label,
                                 dataclasses.replace(real, emulate=True)).name for real in _GPU_FORMATS}


# Registered policies a default sweep leaves out: nobody deploys float64 inference, and it doubles the time
# of a sweep whose question is "which cheaper format keeps my outputs". Still runnable by name.
# Compiling a training step (forward and backward graphs) takes minutes on a small CPU: by name only there; on a
# GPU it takes seconds, and the compiled float policies are float8 training's fair baselines.
# The state policies answer a question of their own (bf16 weights that keep their updates; see the bench note when
# pure bf16 loses them): named, not in every sweep.
# Emulated numerics run with --emulate (or by name), never in a plain sweep.
NOT_IN_DEFAULT_SWEEP = {"train": frozenset({"fp32+compile", "bf16+compile", "amp-bf16+compile", "bf16-sr",
                                            "bf16-kahan", *EMULATED.values(), *FINE_TUNING.values()}),
                        "infer": frozenset({"fp64", "amp-bf16+compile", *EMULATED.values()})}
NOT_IN_DEFAULT_GPU_SWEEP = {"train": frozenset({"bf16-sr", "bf16-kahan", *EMULATED.values(), *FINE_TUNING.values()}),
                            "infer": frozenset({*NOT_IN_DEFAULT_SWEEP["infer"]})}


def policies_for(mode: str) -> list[str]:
    """Every registered policy that can run in ``mode`` (train or infer), in registry order."""
    return [name for name, plan in REGISTRY.items() if mode in plan.modes]


def default_policies(mode: str, device: str = "cuda") -> list[str]:
    """What ``bench`` runs when no policy is named: ``policies_for(mode)`` less ``NOT_IN_DEFAULT_SWEEP``, less what a
    user's file registered (``NAMED_ONLY``), and on a CPU (``device``) less the GPU-only ones."""
    cpu = device.startswith("cpu")
    left_out = (NOT_IN_DEFAULT_SWEEP if cpu else NOT_IN_DEFAULT_GPU_SWEEP).get(mode, frozenset())
    return [name for name in policies_for(mode) if name not in left_out and name not in NAMED_ONLY
            and not (cpu and REGISTRY[name].gpu_only)]


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


# the modifiers a policy takes, in the words of one line (``dtypelab policies`` lists them too)
MODIFIERS = (f"+compile, +ckpt, +chunked-ce or +chunked-ceN (the loss in N chunks), "
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
                + f"; modifiers: {MODIFIERS}")
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


