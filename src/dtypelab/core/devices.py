"""The GPUs a forecast can be made for: how much memory each gives a PyTorch program, and its compute capability
(which formats it runs: bfloat16 from 8.0, float8 from 8.9).

The memory is what ``torch.cuda.get_device_properties().total_memory`` reports (the "total capacity" CUDA's
out-of-memory message quotes), not the datasheet's round figure: the driver keeps part of the card. Where such a
report was found it is used as is; elsewhere it is NVML's total (what nvidia-smi shows) less 0.55 GiB, the median
of what the driver kept on the cards with both figures (0.25 to 0.75 GiB). Sources:

- NVML totals (MiB): Modal's table, thundergolfer.com/blog/nvidia-gpu-memory-capacity (H200 143,771; H100 81,559;
  A100 80GB 81,920; A100 40GB 40,960; A10 23,028; L40S 46,068; L4 23,034; T4 15,360), and nvidia-smi in
  RLinf/RLinf#255 (RTX 4090: 24,564).
- torch's total capacity (GiB), from CUDA out-of-memory messages: H100 80GB HBM3 79.11 (vllm-project/vllm#27508),
  A100 80GB 79.25 (levihsu/OOTDiffusion#235), A100 40GB 39.50 (TianheWu/CoSeR#10), L40S 44.42
  (stepfun-ai/Step-Video-T2V#8), L4 22.03 (ArcInstitute/evo2#190), RTX 4090 23.52 (Soul-AILab/SoulX-FlashTalk#5;
  23.64 and 23.68 elsewhere: the smallest is kept), RTX 3090 23.70 (yandex/YaLM-100B#9), T4 14.75
  (hpcaitech/Open-Sora#697).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from dtypelab.core.errors import DtypelabError

GIB = 2**30
DRIVER_KEEPS_GIB = 0.55  # NVML's total less torch's, the median over the cards above that have both


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # what --device takes
    label: str  # what the table says
    datasheet: str  # the marketed capacity
    capability: tuple[int, int]
    torch_gib: float | None = None  # torch's total capacity where a report of it was found
    nvml_mib: int | None = None  # NVML's total
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        if self.torch_gib is not None:
            return int(self.torch_gib * GIB)
        assert self.nvml_mib is not None
        return int((self.nvml_mib / 1024 - DRIVER_KEEPS_GIB) * GIB)

    @property
    def source(self) -> str:
        if self.torch_gib is not None:
            return "the total capacity torch reports for it"
        return f"NVML's total ({self.nvml_mib:,} MiB) less the {DRIVER_KEEPS_GIB} GiB the driver typically keeps"


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("H200", "NVIDIA H200", "141 GB HBM3e", (9, 0), nvml_mib=143771, aliases=("h200-141gb", "gh200")),
    DeviceSpec("H100", "NVIDIA H100 80GB", "80 GB HBM3", (9, 0), torch_gib=79.11, nvml_mib=81559,
               aliases=("h100-80gb", "h100-sxm", "h100-pcie", "h100 80gb hbm3")),
    DeviceSpec("A100-80GB", "NVIDIA A100 80GB", "80 GB HBM2e", (8, 0), torch_gib=79.25, nvml_mib=81920,
               aliases=("a100-80", "a100 80gb")),
    DeviceSpec("A100-40GB", "NVIDIA A100 40GB", "40 GB HBM2", (8, 0), torch_gib=39.50, nvml_mib=40960,
               aliases=("a100-40", "a100 40gb")),
    DeviceSpec("L40S", "NVIDIA L40S", "48 GB GDDR6", (8, 9), torch_gib=44.42, nvml_mib=46068),
    DeviceSpec("RTX4090", "NVIDIA GeForce RTX 4090", "24 GB GDDR6X", (8, 9), torch_gib=23.52, nvml_mib=24564,
               aliases=("4090", "rtx-4090", "geforce rtx 4090")),
    DeviceSpec("RTX3090", "NVIDIA GeForce RTX 3090", "24 GB GDDR6X", (8, 6), torch_gib=23.70,
               aliases=("3090", "rtx-3090", "geforce rtx 3090")),
    DeviceSpec("L4", "NVIDIA L4", "24 GB GDDR6", (8, 9), torch_gib=22.03, nvml_mib=23034),
    DeviceSpec("A10", "NVIDIA A10", "24 GB GDDR6", (8, 6), nvml_mib=23028, aliases=("a10g",)),
    DeviceSpec("T4", "NVIDIA T4", "16 GB GDDR6", (7, 5), torch_gib=14.75, nvml_mib=15360, aliases=("tesla-t4",)),
)


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower().removeprefix("nvidia").strip())


_BY_KEY = {_key(k): d for d in DEVICES for k in (d.name, d.label, *d.aliases)}


def device_spec(name: str) -> DeviceSpec:
    """The table's entry for ``name`` (any spelling of its name, label or an alias); a one-line error otherwise."""
    found = _BY_KEY.get(_key(name))
    if found is not None:
        return found
    if _key(name) == "a100":
        raise DtypelabError("--device A100 is ambiguous: say A100-80GB or A100-40GB")
    close = difflib.get_close_matches(_key(name), list(_BY_KEY), n=1, cutoff=0.6)
    hint = f" (did you mean {_BY_KEY[close[0]].name}?)" if close else ""
    raise DtypelabError(f"unknown device {name!r}{hint}: use one of {', '.join(d.name for d in DEVICES)} "
                        "(dtypelab forecast --devices lists them), cpu, cuda, or give --memory SIZE")
