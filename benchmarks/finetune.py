"""Fine-tuning precision, checked: the 4-bit base's library, the forecast's time on an 8B config, and bench on the
pretrained MiniLM.

    python benchmarks/finetune.py [--part nf4,speed,bench] [--out DIR]

nf4: torchao's NF4 (torchtune's way) against bitsandbytes' 4-bit NF4 (the Hugging Face way; its CPU backend), on this
    CPU: one 4096 x 4096 frozen layer's forward and input gradient on 512 bfloat16 rows (a LoRA base layer's work),
    the dequantized weight's error, the stored bytes, and whether each traces on fake tensors (what the forecast needs).
    bitsandbytes is not a dtypelab dependency: ``pip install bitsandbytes`` to compare.
(The published fine-tuning peaks are the validation set's train-peak cases: ``python benchmarks/validate.py``.)
speed: a Llama-3-8B config (benchmarks/configs/llama3-8b), five fine-tuning policies with and without +ckpt, forecast
    for an RTX 4090, timed as a user runs it: peaks only, with the fit and time, and with the largest-batch search.
bench: `bench minilm-ft`: full fine-tuning in fp32 and amp-bf16 beside every fine-tuning policy this CPU runs.

Run it alone: nothing else may use the CPU. Say which CPU (``dtypelab hardware``) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
MB, MIB, GIB = 1e6, 2**20, 2**30
FINE = "lora-bf16,qlora-nf4,lora-int8,lora-fp8,lora-fp32"
SPEED = ",".join([*("amp-bf16", *FINE.split(",")[:4]), *(f"{p}+ckpt" for p in ("amp-bf16", *FINE.split(",")[:4]))])


def dtypelab(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtypelab", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"}, cwd=ROOT)


def forecast(out: Path, name: str, *args: str) -> tuple[dict, float]:
    path = out / f"{name}.json"
    start = time.perf_counter()
    done = dtypelab("forecast", *args, "--json", str(path))
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"forecast {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(path.read_text()), seconds


# --- nf4 ----------------------------------------------------------------------------------------------------------
def nf4(out: Path) -> dict:
    import torch

    from dtypelab.core.backends import torchao_module

    to_nf4 = torchao_module("quantization").to_nf4
    torch.manual_seed(0)
    n = k = 4096
    weight = (torch.randn(n, k) * 0.02).bfloat16()
    x = torch.randn(512, k, dtype=torch.bfloat16, requires_grad=True)

    def timed(step) -> float:
        step()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return sorted(times)[2]

    def traces(make) -> str:
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode():
                make(torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(4, 512, dtype=torch.bfloat16,
                                                                             requires_grad=True))
            return "yes"
        except Exception as exc:
            return f"no ({type(exc).__name__})"

    rows = {}
    q = to_nf4(weight, 64, 256)
    inner = [getattr(q, a) for a in q.__tensor_flatten__()[0]]
    rows["torchao NF4"] = {
        "fwd+bwd s": timed(lambda: torch.nn.functional.linear(x, q).sum().backward()),
        "mean abs error": (q.get_original_weight().float() - weight.float()).abs().mean().item(),
        "bytes": sum(t.untyped_storage().nbytes() for t in inner),
        "traces on fake tensors": traces(lambda w, i: torch.nn.functional.linear(i, to_nf4(w, 64, 256)).sum()
                                         .backward()),
    }
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except ImportError as exc:
        rows["bitsandbytes NF4"] = {"skipped": f"bitsandbytes is not installed ({exc})"}
    else:
        data, state = bf.quantize_4bit(weight, quant_type="nf4", compress_statistics=True, blocksize=64)
        nested = [data, state.absmax, *((state.state2.absmax, state.state2.code) if state.nested else ()),
                  state.code]
        rows["bitsandbytes NF4"] = {
            "version": bnb.__version__,
            "fwd+bwd s": timed(lambda: bnb.matmul_4bit(x, data.t(), quant_state=state).sum().backward()),
            "mean abs error": (bf.dequantize_4bit(data, state, quant_type="nf4").float() - weight.float()).abs()
            .mean().item(),
            "bytes": sum(t.untyped_storage().nbytes() for t in nested),
            "traces on fake tensors": traces(lambda w, i: bnb.matmul_4bit(i, bf.quantize_4bit(
                w, quant_type="nf4", compress_statistics=True)[0].t(), quant_state=bf.quantize_4bit(
                w, quant_type="nf4", compress_statistics=True)[1]).sum().backward()),
        }
    rows["bfloat16 dense"] = {"fwd+bwd s": timed(lambda: (x @ weight.t()).sum().backward()),
                              "bytes": weight.numel() * 2}
    for name, row in rows.items():
        print(f"{name:18s} " + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                                         for k, v in row.items()))
    (out / "nf4.json").write_text(json.dumps(rows, indent=1))
    return rows


# --- speed --------------------------------------------------------------------------------------------------------
def speed(out: Path) -> dict:
    config = f"hf:{CONFIGS / 'llama3-8b'}"
    common = ("--seq-len", "2048", "-p", SPEED, "--batch-size", "1")
    runs = {}
    for name, extra in (("peaks", ()), ("fit", ("--device", "RTX4090", "--no-batch-search")),
                        ("fit+search", ("--device", "RTX4090"))):
        report, seconds = forecast(out, f"llama3-8b-{name}", config, *common, *extra)
        runs[name] = {"seconds": seconds, "answer": report.get("answer", "")}
        print(f"{name}: {seconds:.1f} s  {report.get('answer', '')}")
    (out / "speed.json").write_text(json.dumps(runs, indent=1))
    return runs


# --- bench --------------------------------------------------------------------------------------------------------
def bench(out: Path) -> None:
    path = out / "minilm-ft.json"
    done = dtypelab("bench", "minilm-ft", "-p", f"fp32,amp-bf16,{FINE.replace('lora-fp8', 'lora-fp8-emulated')}",
                    "--json", str(path), timeout=7200)
    print(done.stdout[-6000:])
    if done.returncode:
        raise SystemExit(f"bench failed:\n{done.stderr[-2000:]}")


PARTS = {"nf4": nf4, "speed": speed, "bench": bench}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--out", default=str(ROOT / "dtypelab-results" / "finetune"), help="where the records go")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.part.split(","):
        print(f"== {part}")
        PARTS[part](out)


if __name__ == "__main__":
    main()
