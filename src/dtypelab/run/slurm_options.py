"""What the fan-out launcher's options mean: which GPUs (``--gpus``), Slurm's time limit (``--time``) and the sbatch
options passed on (``--slurm-args``), each a one-line error when malformed."""

from __future__ import annotations

import re

from dtypelab.core.errors import DtypelabError


def parse_gpus(text: str | None) -> tuple[int, ...] | None:
    """--gpus 0,1,3 → (0, 1, 3); None when not given."""
    if text is None or not str(text).strip():
        return None
    try:
        gpus = tuple(int(g) for g in str(text).split(","))
    except ValueError:
        raise DtypelabError(f"--gpus: give GPU indices separated by commas, such as 0,1,2,3; got {text!r}") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise DtypelabError(f"--gpus: each GPU index once, none negative; got {text!r}")
    return gpus


def parse_minutes(text: str | int | float | None) -> int | None:
    """Slurm's time limit: minutes, or [D-]HH:MM:SS / MM:SS as Slurm writes it."""
    if text is None or text == "":
        return None
    s = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", s)
    if m:
        days, hours, minutes, seconds = (int(x) if x else 0 for x in m.groups())
        if m.group(2) is None:  # MM:SS
            hours, minutes, seconds = 0, int(m.group(3)), int(m.group(4))
        total = days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    elif s.isdigit():
        total = int(s)
    else:
        raise DtypelabError(f"--time: give minutes or HH:MM:SS, such as 90 or 1:30:00; got {text!r}")
    if total < 1:
        raise DtypelabError(f"--time: at least one minute; got {text!r}")
    return total


def parse_slurm_args(text: str | None) -> dict[str, str]:
    """--slurm-args 'account=ml,qos=high' → the sbatch options submitit passes on unchanged."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DtypelabError(f"--slurm-args: give KEY=VALUE pairs separated by commas; got {item!r}")
        out[key.strip().lstrip("-").replace("-", "_")] = value.strip()
    return out

__all__ = ["parse_gpus", "parse_minutes", "parse_slurm_args"]
