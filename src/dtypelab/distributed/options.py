"""What ``bench --nproc`` asks of torchrun, checked: the settings of ``dtypelab.run``'s torchrun launcher and the links
of the scaling estimate, or a one-line error for what a distributed run cannot do."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from dtypelab.core.errors import DtypelabError
from dtypelab.distributed.scaling import parse_links
from dtypelab.run import Torchrun


def torchrun_settings(nproc: int, nnodes: int, rdzv_endpoint: str | None, torchrun_args: str | Sequence[str] | None,
                      link_gbps: str | Sequence[str | float] | None, *, mode: str, per_layer: bool, profile: bool,
                      rounds: int | None, launcher: object) -> tuple[Torchrun, tuple[tuple[str, float], ...]]:
    if nnodes > 1 and not rdzv_endpoint:
        raise DtypelabError("nnodes: more than 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    refused = [flag for flag, given in (("--mode infer", mode != "train"), ("--per-layer", per_layer),
                                        ("--profile", profile), ("--rounds", bool(rounds))) if given]
    if refused:
        raise DtypelabError(f"{', '.join(refused)}: not with --nproc (distributed runs measure training, each "
                            "policy in its own torchrun job)")
    if launcher not in (None, "torchrun"):
        raise DtypelabError("--nproc runs every policy under torchrun; it takes no other launcher")
    try:
        extra = tuple(shlex.split(torchrun_args) if isinstance(torchrun_args, str) else torchrun_args or ())
    except ValueError as exc:
        raise DtypelabError(f"torchrun_args: {exc} (--torchrun-args)") from None
    return Torchrun(nproc, nnodes, rdzv_endpoint, extra), parse_links(link_gbps)
