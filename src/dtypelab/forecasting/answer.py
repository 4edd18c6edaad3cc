"""The forecast's answer in words: what fits the device (or the smallest GPU of the table each policy needs, or by
how much the smallest peak misses), for training and for the inference formats; and the notes under the table."""

from __future__ import annotations

from dtypelab.core.machine.devices import DEVICES, device_spec
from dtypelab.core.machine.hardware import HardwareInfo
from dtypelab.core.policies import Plan, get_policy
from dtypelab.core.results import PolicyForecast, TargetDevice
from dtypelab.core.text import GIB, size_text


def smallest_device(result: PolicyForecast, plan: Plan, reserve: int) -> str | None:
    """The smallest GPU of the table whose memory holds the decisive peak and that runs the policy; "" for none."""
    peak = result.peak
    if peak is None or result.untraced:
        return None
    for spec in sorted(DEVICES, key=lambda d: d.memory_bytes):
        hw = HardwareInfo(device="cuda", device_name=spec.label, cpu_name="", cpu_flags=(), cpu_capability="",
                          cuda_capability=spec.capability, threads=0)
        if peak.peak_bytes <= spec.memory_bytes - reserve and plan.availability(hw).ok:
            return spec.name
    return ""


def answer(results: list[PolicyForecast], device: TargetDevice) -> str:
    """The forecast in a sentence: for training (an inference-only task: inference), what fits the device, or the
    smallest GPU each needs, or, when nothing fits, the smallest peak and by how much it misses; then the same of
    the inference-only formats, in a clause of their own."""
    untraced = [r for r in results if r.status == "ok" and r.peak is not None and r.untraced]
    ok = [r for r in results if r.status == "ok" and r.peak is not None and not r.untraced]
    said = (f" {', '.join(r.policy for r in untraced)}: the step could not be traced, so no peak, fit or time is "
            f"forecast (its state alone takes at least {size_text(min(r.peak.peak_bytes for r in untraced))})."
            if untraced else "")
    if not ok:
        return "Nothing was forecast: every policy was skipped, failed or could not be traced (see each one's " \
               "reason)." + said
    trained = [r for r in ok if r.train is not None]
    first = _sentence(trained or ok, device, "training" if trained else "inference") + _loss_clause(trained, device)
    served = [r for r in ok if r.train is None]
    return (first if not (trained and served) else f"{first} {_sentence(served, device, 'inference')}") + said


def _sentence(ok: list[PolicyForecast], device: TargetDevice, what: str) -> str:
    smallest = min(ok, key=lambda r: r.peak.peak_bytes)
    usable = device.usable_bytes
    head = what[0].upper() + what[1:]
    if usable is not None:
        fits = [r for r in ok if r.peak.peak_bytes <= usable and not r.runs_there]
        where = f"{device.label} ({size_text(usable)} usable)"
        if not fits:
            short = size_text(smallest.peak.peak_bytes - usable)
            return (f"{head} fits nowhere on {where}: smallest peak: {smallest.policy} at "
                    f"{size_text(smallest.peak.peak_bytes)}, {short} more than there is.")
        best = min(fits, key=lambda r: r.peak.peak_bytes)
        cannot = [r.policy for r in ok if r.runs_there]
        short = [r.policy for r in ok if r.peak.peak_bytes > usable and not r.runs_there]
        return (f"{head} on {where}: {len(fits)} of {len(ok)} fit ({', '.join(_fitting(r) for r in fits)})"
                + (f"; {', '.join(short)} {'does' if len(short) == 1 else 'do'} not" if short else "")
                + f"; smallest peak: {best.policy} at {size_text(best.peak.peak_bytes)}"
                + (f"; {', '.join(cannot)} cannot run there" if cannot else "") + ".")
    if not any(r.smallest_device for r in ok):
        largest = max(DEVICES, key=lambda d: d.memory_bytes)
        return (f"{head} fits nowhere in the table (the largest, {largest.label}, has "
                f"{size_text(largest.memory_bytes)}): smallest peak: {smallest.policy} at "
                f"{size_text(smallest.peak.peak_bytes)}.")
    return (f"{head}: smallest peak: {smallest.policy} at {size_text(smallest.peak.peak_bytes)}"
            + (f" (fits {device_spec(smallest.smallest_device).label} and larger)" if smallest.smallest_device
               else " (no GPU of the table runs it)") + ".")


def _loss_clause(trained: list[PolicyForecast], device: TargetDevice) -> str:
    """When a language model's loss holds the peak (more than the activations, and a tenth of it at least): how much,
    and what its chunked computation (``+chunked-ce``) makes of the peak where it was forecast, or how to see it."""
    by_name = {r.policy: r for r in trained}
    heavy = [r for r in trained if r.train is not None and not get_policy(r.policy).loss
             and r.train.breakdown.get("loss", 0) >= max(r.train.breakdown.get("activations", 0),
                                                         r.train.peak_bytes / 10)]
    if not heavy:
        return ""
    worst = max(heavy, key=lambda r: r.train.breakdown["loss"])  # type: ignore[union-attr]
    peak = worst.train.peak_bytes  # type: ignore[union-attr]
    held = worst.train.breakdown["loss"]  # type: ignore[union-attr]
    text = (f" The loss holds {size_text(held)} of {worst.policy}'s {size_text(peak)} peak ({held / peak:.0%}: its "
            "logits as wide as the vocabulary, all upcast to float32 at once)")
    chunked_name = get_policy(worst.policy).with_loss("chunked-ce").name
    chunked = by_name.get(chunked_name)
    if chunked is None or chunked.train is None:
        return text + f"; {chunked_name} computes it in chunks: forecast that policy to see its peak."
    fits = "" if device.usable_bytes is None else (
        " and fits" if chunked.train.peak_bytes <= device.usable_bytes else " and does not fit either")
    return text + f"; {chunked_name} computes it in chunks: {size_text(chunked.train.peak_bytes)}{fits}."


def _fitting(result: PolicyForecast) -> str:
    """A policy that fits, with the largest batch the search traced to fit (all ranks), where it searched."""
    fit = result.train_fit if result.train is not None else result.infer_fit
    if fit is None or fit.largest_batch is None:
        return result.policy
    return f"{result.policy} " + (f"at batch {fit.largest_batch} and more" if fit.capped else
                                  f"up to batch {fit.largest_batch}")


def device_notes(device: TargetDevice, nproc: int) -> tuple[str, ...]:
    notes = ["peaks are tensors' bytes as the allocator holds them (CUDA's in blocks of 512 bytes), per rank; what "
             "is outside the allocator (the CUDA context, cuBLAS's workspace) is the reserve"
             if device.kind == "cuda" else "peaks are tensors' bytes, per rank"]
    if device.memory_bytes is not None:
        notes.append(f"{device.label}: {size_text(device.memory_bytes)} ({device.memory_bytes / GIB:.4g} GiB, "
                     f"{device.source})" + (f", less {size_text(device.reserve_bytes)} reserved"
                                             if device.reserve_bytes else ""))
    if device.kind == "cuda":
        notes.append("traced as on a CUDA GPU: torch's optimizers update every parameter at once there (foreach), "
                     "which holds one more copy of what they update while they do")
    if nproc > 1:
        notes.append(f"{nproc} ranks: FSDP2 shards weights, gradients and optimizer state and gathers each unit's "
                     "weights for its forward and backward; DDP keeps everything whole and one more copy of the "
                     "gradients in its buckets; the batch is split over the ranks")
    return tuple(notes)


__all__ = ["answer", "device_notes", "smallest_device"]
