"""``dtypelab policies``: every registered policy, what it does, and whether it runs on this machine."""

from __future__ import annotations

from dtypelab.core.machine.hardware import HardwareInfo, probe, resolve_device
from dtypelab.core.policies import REGISTRY, default_policies


def policy_table(device: str | None = None, hardware: HardwareInfo | None = None) -> list[tuple[str, str, str]]:
    """(name, summary, verdict here) for every registered policy; inference-only ones say so."""
    dev = resolve_device(device)
    hw = hardware or probe(dev)  # a given probe was checked against the device by hardware_for
    rows = []
    for name, plan in REGISTRY.items():
        avail = plan.availability(hw)
        verdict = "runs" if avail.ok and not avail.slow else (
            f"skipped unless --force: {avail.reason}" if avail.ok else f"not here: {avail.reason}")
        if plan.modes == ("infer",):
            verdict += " (inference only)"
        left_out = [m for m in plan.modes if name not in default_policies(m, dev.type)]
        if left_out and avail.ok:
            verdict += f" (not in the default {', '.join(left_out)} sweep; name it to run it)"
        rows.append((name, plan.describe(), verdict))
    return rows
