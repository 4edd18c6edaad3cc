"""Fine-tuning precision, checked: the 4-bit base's library, the forecast against published fine-tuning figures, the
forecast's time on an 8B config, and bench on the pretrained MiniLM.

    python benchmarks/finetune.py [--part nf4,published,speed,bench] [--out DIR]

nf4: torchao's NF4 (torchtune's way) against bitsandbytes' 4-bit NF4 (the Hugging Face way; its CPU backend), on this
    CPU: one 4096 x 4096 frozen layer's forward and input gradient on 512 bfloat16 rows (a LoRA base layer's work),
    the dequantized weight's error, the stored bytes, and whether each traces on fake tensors (what the forecast needs).
    bitsandbytes is not a dtypelab dependency: ``pip install bitsandbytes`` to compare.
published: the forecast against published fine-tuning memory, at the conditions the sources state (printed with
    each): the QLoRA paper (Dettmers et al. 2023, arXiv 2305.14314, section 4), torchtune's README tables (April 2024:
    Llama-2-7B; since September 2024: Llama-3.1-8B LoRA and QLoRA, Llama-3.1-70B LoRA on 8 GPUs) and litgpt's config
    hub (Llama-3.1-8B LoRA).
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


# --- published ----------------------------------------------------------------------------------------------------
def published(out: Path) -> list[dict]:
    """Each published figure beside the forecast at the conditions its source states."""
    rows = []
    # QLoRA paper, section 4 (LLaMA 7B, batch 1): "the 4-bit base model consumes 5,048 MB of memory"; its repository
    # (qlora.py) quantizes every Linear but lm_head with NF4 and double quantization, keeps the embeddings and the head
    # in bfloat16 after prepare_model_for_kbit_training, the norms in float32.
    report, _ = forecast(out, "qlora-7b", f"hf:{CONFIGS / 'llama2-7b'}", "--seq-len", "512", "-p",
                         "qlora-nf4,qlora-nf4+ckpt", "--batch-size", "1", "--kbit-upcast")
    base = report["policies"][0]["train"]["breakdown"]["frozen_weights"]
    rows.append({"source": "QLoRA paper (arXiv 2305.14314, section 4): LLaMA-7B's 4-bit base model",
                 "published": "5,048 MB", "forecast": f"{base / MB:,.0f} MB (frozen base, upcast as "
                 "prepare_model_for_kbit_training does)", "ratio": base / (5048 * MB)})
    report, _ = forecast(out, "qlora-7b-bf16", f"hf:{CONFIGS / 'llama2-7b'}", "--seq-len", "512", "-p", "qlora-nf4",
                         "--batch-size", "1")
    base = report["policies"][0]["train"]["breakdown"]["frozen_weights"]
    rows.append({"source": "the same, the embeddings and head in bfloat16 as qlora.py leaves them",
                 "published": "5,048 MB", "forecast": f"{base / MB:,.0f} MB", "ratio": base / (5048 * MB)})
    # torchtune README (April 2024): Llama-2-7B on one RTX 4090, max_memory_reserved over the run; configs
    # 7B_qlora_single_device (LoRA r=8 on q, k, v, output and the MLP) and 7B_lora_single_device (q and v), batch 2,
    # activation checkpointing, alpaca with max_seq_len 512
    for name, policy, targets, value in (("QLoRA", "qlora-nf4+ckpt", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                          "down_proj", 9.29), ("LoRA", "lora-bf16+ckpt", "q_proj,v_proj", 17.18)):
        report, _ = forecast(out, f"torchtune-{name.lower()}", f"hf:{CONFIGS / 'llama2-7b'}", "--seq-len", "512",
                             "-p", policy, "--batch-size", "2", "--lora-targets", targets, "--device", "RTX4090",
                             "--no-batch-search")
        peak = report["policies"][0]["train"]["peak_bytes"]
        rows.append({"source": f"torchtune README: {name} Llama-7B, 1 x RTX 4090 (batch 2, seq 512, checkpointing)",
                     "published": f"{value} GB", "forecast": f"{peak / 1e9:.2f} GB (peak allocated in a step)",
                     "ratio": peak / (value * 1e9)})
    rows += torchtune_2024(out) + litgpt(out)
    for r in rows:
        print(f"{r['source']}: published {r['published']}, forecast {r['forecast']}; forecast/published "
              f"{r['ratio']:.2f} ({'within' if abs(r['ratio'] - 1) <= 0.15 else 'outside'} 15%)")
    (out / "published.json").write_text(json.dumps(rows, indent=1))
    return rows


# torchtune README, "Memory and training speed" (since Sep 2024, pytorch/torchtune 30b8519e8, unchanged at bd2a0fc7 of
# Apr 2026): "batch size 2 (without gradient accumulation), a dataset packed to sequence length 2048, and torch compile
# enabled"; the configs of that commit: activation checkpointing, CEWithChunkedOutputLoss (8 chunks), dtype bf16 (the
# adapters and their AdamW state too); peaks are per GPU, over one epoch. The 70B row: 8 x A100, FSDP.
TORCHTUNE_2024 = (
    ("LoRA Llama-3.1-8B, 1 x RTX 4090", "llama3.1-8b", "lora-bf16-pure+compile+ckpt+chunked-ce", "q_proj,v_proj",
     ("--lora-rank", "8", "--lora-alpha", "16", "--batch-size", "2", "--device", "RTX4090"), 16.2),
    ("QLoRA Llama-3.1-8B, 1 x RTX 4090", "llama3.1-8b", "qlora-nf4-pure+compile+ckpt+chunked-ce",
     "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
     ("--lora-rank", "8", "--lora-alpha", "16", "--batch-size", "2", "--device", "RTX4090"), 7.4),
    ("LoRA Llama-3.1-70B, 8 x A100 (FSDP)", "llama3.1-70b", "lora-bf16-pure+compile+ckpt+chunked-ce+fsdp",
     "q_proj,k_proj,v_proj", ("--lora-rank", "16", "--lora-alpha", "32", "--batch-size", "16", "--nproc", "8",
                              "--device", "A100-80GB"), 27.6),
)


def torchtune_2024(out: Path) -> list[dict]:
    rows = []
    for what, config, policy, targets, extra, gib in TORCHTUNE_2024:
        report, _ = forecast(out, f"torchtune-{config}-{policy}", f"hf:{CONFIGS / config}", "--seq-len", "2048", "-p",
                             policy, "--lora-targets", targets, *extra, "--no-batch-search", "--no-speed")
        peak = report["policies"][0]["train"]["peak_bytes"]
        rows.append({"source": f"torchtune README: {what} (batch 2 a GPU, packed to 2048, compiled, checkpointed, "
                     "chunked cross-entropy, bf16)", "published": f"{gib} GiB",
                     "forecast": f"{peak / GIB:.2f} GiB ({policy})", "ratio": peak / (gib * GIB)})
    return rows


def litgpt(out: Path) -> list[dict]:
    """litgpt's config hub table (config_hub/finetune/README.md, Lightning-AI/litgpt 26857050): llama-3.1-8b/lora.yaml
    on 1 x A10G, 19.73 GB, torch.cuda.max_memory_allocated() / 1e9 over the run (its validation too): bf16-true (the
    adapters too), LoRA r=32, alpha 16 on the query and value, micro batch 1, max_seq_length 512, no checkpointing, its
    chunked_cross_entropy (the head and the loss in 128-token chunks: 4 here). Not modelled: its adapters' dropout
    (0.05: a dropped copy of each adapter's input) and its loss keeps the bfloat16 logits, not float32 ones."""
    report, _ = forecast(out, "litgpt-llama3.1-8b-lora", f"hf:{CONFIGS / 'llama3.1-8b'}", "--seq-len", "512", "-p",
                         "lora-bf16-pure+chunked-ce4", "--lora-rank", "32", "--lora-alpha", "16", "--lora-targets",
                         "q_proj,v_proj", "--batch-size", "1", "--device", "A10", "--no-batch-search", "--no-speed")
    peak = report["policies"][0]["train"]["peak_bytes"]
    return [{"source": "litgpt config hub: llama-3.1-8b/lora.yaml, 1 x A10G (micro batch 1, 512 tokens, bf16-true)",
             "published": "19.73 GB", "forecast": f"{peak / 1e9:.2f} GB (lora-bf16-pure+chunked-ce4)",
             "ratio": peak / 19.73e9}]


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


PARTS = {"nf4": nf4, "published": published, "speed": speed, "bench": bench}


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
