"""The GPUs a forecast can be made for: how much memory each gives a PyTorch program, its compute capability
(which formats it runs: bfloat16 from 8.0, float8 from 8.9), its dense peak FLOP/s per dtype and its memory
bandwidth (what a forecast of speed is made from).

The memory is what ``torch.cuda.get_device_properties().total_memory`` reports (the "total capacity" CUDA's
out-of-memory message quotes), not the datasheet's round figure: the driver keeps part of the card. Where such a
report was found it is used as is; elsewhere it is NVML's total (what nvidia-smi shows) less 0.55 GiB, the median
of what the driver kept on the cards with both figures (0.25 to 0.75 GiB). Sources:

- NVML totals (MiB): Modal's table, thundergolfer.com/blog/nvidia-gpu-memory-capacity (H200 143,771; H100 81,559;
  A100 80GB 81,920; A100 40GB 40,960; A10 23,028; L40S 46,068; L4 23,034; T4 15,360), and nvidia-smi in
  RLinf/RLinf#255 (RTX 4090: 24,564) and NVIDIA/gpu-admin-tools#4 (H100 NVL: 95,830).
- torch's total capacity (GiB), from CUDA out-of-memory messages: H100 80GB HBM3 79.11 (vllm-project/vllm#27508),
  A100 80GB 79.25 (levihsu/OOTDiffusion#235), A100 40GB 39.50 (TianheWu/CoSeR#10), L40S 44.42
  (stepfun-ai/Step-Video-T2V#8), L4 22.03 (ArcInstitute/evo2#190), RTX 4090 23.52 (Soul-AILab/SoulX-FlashTalk#5;
  23.64 and 23.68 elsewhere: the smallest is kept), RTX 3090 23.70 (yandex/YaLM-100B#9), T4 14.75
  (hpcaitech/Open-Sora#697).

Peaks (``DeviceSpec.rates``: dense, without structured sparsity, TFLOP/s; int8 in TOPS; float64 is the FP64 tensor-core
figure cuBLAS's DGEMM uses) and memory bandwidth (``bandwidth_gbs``, GB/s) are NVIDIA's datasheets: H100 (SXM5, PCIe,
NVL), H200, A100 (40GB and 80GB SXM4), L40S, L4, A10 and T4; for the GeForce cards the architecture whitepapers'
figures with FP32 accumulation (what PyTorch's matmuls accumulate in): Ada Lovelace (RTX 4090) and GA102 (RTX 3090).
A dtype a card has no figure for (float64 on the GeForce cards, L40S, L4, A10; bfloat16 and float8 on a T4) has no
rate: a forecast of a policy computing in it says so.

Power (``limit_watts``, ``idle_watts``; what the energy forecast runs between, ``core.machine.power``): the limit is the
datasheet's maximum board power (TDP) of the form factor named (SXM5 700 W for H100 and H200, PCIe 350 W, NVL 400 W,
A100 SXM4 400 W, L40S 350 W, RTX 4090 450 W, RTX 3090 350 W, L4 72 W, A10 150 W, T4 70 W). Idle is the power of the
card doing nothing in its working state (P0: what it draws between a program's kernels), read off published
nvidia-smi tables at 0% utilization: H100 80GB HBM3 69-72 W (eight cards of one node), H200 73-77 W (five tables),
A100-SXM4-40GB 50-58 W (six tables), A100-SXM4-80GB 70 W, RTX 3090 61 W (P0), L4 27-28 W (P0 at 4%), A10 42 W
(P0 at 5%), T4 26 W (P0). Where only the P8 sleep state's figure was found (RTX 4090: 17-25 W) it is kept and
``idle_from`` says so: a card holding a CUDA context idles higher. The H100 PCIe and NVL and the L40S have no
published idle reading here: ``idle_watts`` is None, and the forecast takes a tenth of the limit (as the H100
SXM's and H200's readings are) and says so.

Interconnect (``link_gbs``, GB/s each way between two cards, what a tensor-parallel all-reduce moves at; ``link``, its
name): NVIDIA's datasheets: NVLink 4 on H100 and H200 SXM 900 GB/s both ways (450 each way), the H100 NVL's NVLink
bridge 600 (300), A100 SXM4's NVLink 3 600 (300); the rest talk over PCIe: Gen5 x16 on the H100 PCIe 128 GB/s both
ways (64), Gen4 x16 on the L40S, L4, A10, RTX 4090 and RTX 3090 64 (32), Gen3 x16 on the T4 32 (16).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from dtypelab.core.errors import DtypelabError

GIB = 2**30
DRIVER_KEEPS_GIB = 0.55  # NVML's total less torch's, the median over the cards above that have both

# Rated dense peaks per rate key (the probe's keys: float64, float32, tf32, bfloat16, float16, fp8, int8), TFLOP/s
_HOPPER_SXM = {"float64": 67, "float32": 67, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5, "fp8": 1979,
               "int8": 1979}
_AMPERE_A100 = {"float64": 19.5, "float32": 19.5, "tf32": 156, "bfloat16": 312, "float16": 312, "int8": 624}


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU: one row of the one table (``DEVICES``): its memory, formats, rates and bandwidth, and the names it
    goes by (``--device``, torch's device name)."""

    name: str  # what --device takes
    label: str  # what the table says
    datasheet: str  # the marketed capacity
    capability: tuple[int, int]
    # a lent GPU's torch.cuda.get_device_name() that is this card (patterns exclude one another: one row per name)
    matches: str
    rates: dict[str, float] = field(default_factory=dict, hash=False)  # dense peak TFLOP/s per rate key
    rates_from: str = "NVIDIA datasheet, dense"
    torch_gib: float | None = None  # torch's total capacity where a report of it was found
    nvml_mib: int | None = None  # NVML's total
    aliases: tuple[str, ...] = ()
    bandwidth_gbs: float | None = None  # the datasheet's memory bandwidth, GB/s
    limit_watts: float | None = None  # the datasheet's maximum board power (TDP)
    idle_watts: float | None = None  # published nvidia-smi readings at 0% utilization (see the module's sources)
    idle_from: str = "P0 at 0% utilization"  # the state the idle figure was read in
    link_gbs: float | None = None  # GB/s each way between two cards (NVLink, else PCIe): tensor parallel's all-reduce
    link: str = ""  # what carries it

    @property
    def peaks(self) -> tuple[str, dict[str, float]]:
        """(where its rates come from, its dense peak TFLOP/s per rate key)."""
        return f"{self.label} ({self.rates_from})", dict(self.rates)

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


_NVL = {"float64": 60, "float32": 60, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "fp8": 1670.5,
        "int8": 1670.5}
DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("H200", "NVIDIA H200", "141 GB HBM3e", (9, 0), r"H200(?!.*NVL)", _HOPPER_SXM, nvml_mib=143771,
               aliases=("h200-141gb", "gh200"), bandwidth_gbs=4800, limit_watts=700, idle_watts=74,
               link_gbs=450, link="NVLink 4"),
    DeviceSpec("H100", "NVIDIA H100 80GB", "80 GB HBM3", (9, 0), r"H100(?!.*(PCIe|NVL))", _HOPPER_SXM,
               torch_gib=79.11, nvml_mib=81559, aliases=("h100-80gb", "h100-sxm", "h100 80gb hbm3"),
               bandwidth_gbs=3350, limit_watts=700, idle_watts=70,
               link_gbs=450, link="NVLink 4"),
    DeviceSpec("H100-PCIe", "NVIDIA H100 PCIe", "80 GB HBM2e", (9, 0), r"H100.*PCIe",
               {"float64": 51, "float32": 51, "tf32": 378, "bfloat16": 756, "float16": 756, "fp8": 1513,
                "int8": 1513}, torch_gib=79.11, nvml_mib=81559, aliases=("h100 pcie",), bandwidth_gbs=2000,
               limit_watts=350,
               link_gbs=64, link="PCIe Gen5 x16"),
    # the H200 NVL's datasheet gives it the same dense rates; its name matches here for them
    DeviceSpec("H100-NVL", "NVIDIA H100 NVL", "94 GB HBM3", (9, 0), r"H[12]00.*NVL", _NVL, nvml_mib=95830,
               aliases=("h100 nvl", "h100nvl"), bandwidth_gbs=3900, limit_watts=400,
               link_gbs=300, link="NVLink bridge"),
    DeviceSpec("A100-80GB", "NVIDIA A100 80GB", "80 GB HBM2e", (8, 0), r"A100.*80GB", _AMPERE_A100, torch_gib=79.25,
               nvml_mib=81920, aliases=("a100-80", "a100 80gb"), bandwidth_gbs=2039, limit_watts=400, idle_watts=70,
               link_gbs=300, link="NVLink 3"),
    DeviceSpec("A100-40GB", "NVIDIA A100 40GB", "40 GB HBM2", (8, 0), r"A100(?!.*80GB)", _AMPERE_A100,
               torch_gib=39.50, nvml_mib=40960, aliases=("a100-40", "a100 40gb"), bandwidth_gbs=1555, limit_watts=400,
               idle_watts=55,
               link_gbs=300, link="NVLink 3"),
    DeviceSpec("L40S", "NVIDIA L40S", "48 GB GDDR6", (8, 9), r"L40S",
               {"float32": 91.6, "tf32": 183, "bfloat16": 362, "float16": 362, "fp8": 733, "int8": 733},
               torch_gib=44.42, nvml_mib=46068, bandwidth_gbs=864, limit_watts=350,
               link_gbs=32, link="PCIe Gen4 x16"),
    DeviceSpec("RTX4090", "NVIDIA GeForce RTX 4090", "24 GB GDDR6X", (8, 9), r"RTX 4090",
               {"float32": 82.6, "tf32": 82.6, "bfloat16": 165.2, "float16": 165.2, "fp8": 330.3, "int8": 660.6},
               "Ada Lovelace whitepaper, FP32 accumulate, dense", torch_gib=23.52, nvml_mib=24564,
               aliases=("4090", "rtx-4090", "geforce rtx 4090"), bandwidth_gbs=1008,
               limit_watts=450, idle_watts=21, idle_from="P8 (the sleep state) at 0% utilization",
               link_gbs=32, link="PCIe Gen4 x16"),
    DeviceSpec("RTX3090", "NVIDIA GeForce RTX 3090", "24 GB GDDR6X", (8, 6), r"RTX 3090",
               {"float32": 35.6, "tf32": 35.6, "bfloat16": 71, "float16": 71, "int8": 284},
               "GA102 whitepaper, FP32 accumulate, dense", torch_gib=23.70,
               aliases=("3090", "rtx-3090", "geforce rtx 3090"), bandwidth_gbs=936, limit_watts=350,
               idle_watts=61,
               link_gbs=32, link="PCIe Gen4 x16"),
    DeviceSpec("L4", "NVIDIA L4", "24 GB GDDR6", (8, 9), r"\bL4\b",
               {"float32": 30.3, "tf32": 60, "bfloat16": 121, "float16": 121, "fp8": 242.5, "int8": 242.5},
               torch_gib=22.03, nvml_mib=23034, bandwidth_gbs=300, limit_watts=72, idle_watts=27,
               idle_from="P0 at 4% utilization",
               link_gbs=32, link="PCIe Gen4 x16"),
    DeviceSpec("A10", "NVIDIA A10", "24 GB GDDR6", (8, 6), r"\bA10\b",
               {"float32": 31.2, "tf32": 62.5, "bfloat16": 125, "float16": 125, "int8": 250}, nvml_mib=23028,
               aliases=("a10g",), bandwidth_gbs=600, limit_watts=150, idle_watts=42,
               idle_from="P0 at 5% utilization",
               link_gbs=32, link="PCIe Gen4 x16"),
    DeviceSpec("T4", "NVIDIA T4", "16 GB GDDR6", (7, 5), r"\bT4\b", {"float32": 8.1, "float16": 65, "int8": 130},
               torch_gib=14.75, nvml_mib=15360, aliases=("tesla-t4",), bandwidth_gbs=320,
               limit_watts=70, idle_watts=26,
               link_gbs=16, link="PCIe Gen3 x16"),
)


def rated_peaks(device_name: str) -> tuple[str, dict[str, float]]:
    """(where the rates come from, the dense peak TFLOP/s per rate key) of the table's row whose pattern a device's
    name (``torch.cuda.get_device_name()``) matches; ("", {}) when none does."""
    for d in DEVICES:
        if re.search(d.matches, device_name):
            return d.peaks
    return "", {}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower().removeprefix("nvidia").strip())


def device_spec(name: str) -> DeviceSpec:
    """The table's entry for ``name`` (any spelling of its name, label or an alias); a one-line error otherwise."""
    by_key = {_key(k): d for d in DEVICES for k in (d.name, d.label, *d.aliases)}
    found = by_key.get(_key(name))
    if found is not None:
        return found
    if _key(name) == "a100":
        raise DtypelabError("--device A100 is ambiguous: say A100-80GB or A100-40GB")
    close = difflib.get_close_matches(_key(name), list(by_key), n=1, cutoff=0.6)
    hint = f" (did you mean {by_key[close[0]].name}?)" if close else ""
    raise DtypelabError(f"unknown device {name!r}{hint}: use one of {', '.join(d.name for d in DEVICES)} "
                        "(dtypelab forecast --devices lists them), cpu, cuda, or give --memory SIZE")
