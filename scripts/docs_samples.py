"""Regenerate every sample output the documentation shows, by running the commands it shows.

    python scripts/docs_samples.py [--only NAME ...] [--list]

Each sample is written to docs/samples/NAME.txt as ``$ command`` followed by what the command printed on
stdout (the table, the notes); progress on stderr is left out. The pages include them (``--8<--``), and the
README's sample is rewritten between its ``<!-- sample:NAME -->`` markers. A header file, docs/samples/machine.txt,
names the machine and versions every sample came from. Nothing in the docs is pasted by hand.

Run it on a quiet machine (the samples time things; two torch processes at once on 2 cores slow each other
10-30x), from the repository's root, in the environment the README's test command makes. It takes a few
minutes; --only regenerates some.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "docs", "samples")
WIDTH = "120"  # the docs' code blocks; a wider table leaves columns out and says which

# name -> (the command as shown, how many of its output lines to keep: 0 for all)
COMMANDS: dict[str, tuple[str, int]] = {
    "hardware": ("dtypelab hardware", 0),
    "policies": ("dtypelab policies", 0),
    "bench-digits": ("dtypelab bench digits", 0),
    "bench-infer": ("dtypelab bench digits --mode infer -p fp32,bf16,int8-dyn-legacy,int8-dyn-legacy-pc,int8-wo,fp8-wo "
                    "--per-layer --steps 20", 0),
    "formats-values": ("dtypelab formats -v 0.1 -v 65520 -v 1e-8 -f fp32,bf16,fp16,e4m3,e5m2,int8", 0),
    "audit": ("dtypelab audit digits --steps 5 --top 10", 0),
    "trace": ("dtypelab trace digits --policy fp16 --force", 0),
    "lint": ("dtypelab lint examples/unstable_training.py", 0),
    "autopilot": ("dtypelab autopilot examples/autopilot_tasks.py:make_drift_task --force --sample-every 5", 0),
    "tune": ("dtypelab tune digits --candidates int8-dyn-legacy-pc,int8-dyn-legacy --min-cosine 0.999", 0),
    "script": ("dtypelab bench examples/train_loop.py -p fp32,amp-bf16 -- --epochs 1", 0),
    "profile": ("dtypelab bench digits -p fp32,amp-bf16 --force --profile --steps 60 --rounds 0", 0),
    "distributed": ("dtypelab bench digits --nproc 2 -p fp32,fp32+ddp-fp16,fp32+fsdp --steps 60", 0),
    "forecast": ("dtypelab forecast llama2-7b --device H100", 0),
    "forecast-devices": ("dtypelab forecast --devices", 0),
    "forecast-finetune": ("dtypelab forecast hf:benchmarks/configs/llama3-8b --seq-len 2048 --device RTX4090 "
                          "-p amp-bf16,lora-bf16,qlora-nf4,lora-bf16+ckpt,qlora-nf4+ckpt", 0),
    "forecast-loss": ("dtypelab forecast hf:benchmarks/configs/llama3.1-8b --seq-len 2048 --batch-size 2 "
                      "--device RTX4090 -p lora-bf16+ckpt,lora-bf16+ckpt+chunked-ce,"
                      "qlora-nf4-pure+compile+ckpt+chunked-ce --no-batch-search --no-speed", 0),
    "forecast-check": ("dtypelab forecast gpt2 --device cpu --check -p fp32,amp-bf16,bf16-kahan,bf16-sr+adam8bit "
                       "--no-batch-search", 0),
    "generate-tinylm": ("dtypelab bench tinylm --mode generate -b 4 --prompt-len 64 --gen-len 32", 0),
    "tune-generate": ("dtypelab tune tinylm --mode generate --gpu h100 --kl-budget 0.004", 0),
    "device-minilm": ("dtypelab bench minilm --mode infer -p et-fp32,et-fp16,et-int8-dyn,et-int8,et-8da4w "
                      "--baseline et-fp32", 0),
    "device-export": ("dtypelab export minilm -p et-int8-dyn -o /tmp/dtypelab-minilm-et-int8-dyn.pte", 0),
    "device-generate": ("dtypelab bench tinylm --mode generate -p et-fp32,et-fp16,et-int8-dyn,et-int8,et-8da4w", 0),
    "generate-h100": ("dtypelab forecast hf:benchmarks/configs/llama3-8b --mode generate --device H100 "
                      "--prompt-len 512 --gen-len 128 -b 16", 0),
    "generate-4090": ("dtypelab forecast hf:benchmarks/configs/llama3-8b --mode generate --device RTX4090 "
                      "--prompt-len 512 --gen-len 128 -b 16", 0),
    "generate-32k": ("dtypelab forecast hf:benchmarks/configs/llama3.1-8b --mode generate --device RTX4090 "
                     "--prompt-len 30000 --gen-len 2768 -b 16 -p bf16,int8-wo,int4-wo,int4-wo+kv-fp8,int4-wo+kv-int8 "
                     "--no-speed", 0),
    "generate-vllm": ("dtypelab forecast hf:benchmarks/configs/llama3.1-8b --mode generate --engine vllm "
                      "--device H100 -p bf16,int8-wo,int4-wo,fp8-dyn-row --prompt-len 256 --gen-len 256 -b 128 "
                      "--max-model-len 16000", 0),
    "generate-check": ("dtypelab forecast tinylm --mode generate --device cpu --check -b 4 --prompt-len 64 "
                       "--gen-len 32 --no-batch-search", 0),
    "energy-h100": ("dtypelab forecast gpt2 --device H100 -p fp32,amp-bf16,bf16,fp8-rowwise --no-batch-search", 0),
    "energy-generate": ("dtypelab forecast hf:benchmarks/configs/llama3.1-8b --mode generate --device H100 "
                        "--prompt-len 512 --gen-len 256 -b 64 -p bf16+compile,fp8-dyn-row+compile,int8-wo+compile,"
                        "int4-wo+compile --no-batch-search", 0),
    "energy-here": ("dtypelab bench digits -p fp32,amp-bf16 --objective energy --force --steps 100", 0),
}
CLI = ("bench", "tune", "forecast", "trace", "autopilot", "audit", "export", "show", "report", "policies", "hardware",
       "formats", "cast", "lint")


def run(command: str, keep: int = 0) -> str:
    """``$ command`` and its stdout (its exit code shown when not 0: trace and lint exit 1 when they find)."""
    env = {**os.environ, "COLUMNS": WIDTH, "DTYPELAB_HEARTBEAT_S": "3600"}
    start = time.monotonic()
    argv = shlex.split(command)
    if argv[0] == "dtypelab":  # this interpreter's dtypelab, whatever PATH holds
        argv = [sys.executable, "-m", "dtypelab", *argv[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    lines = [ln.rstrip() for ln in done.stdout.rstrip().splitlines()]
    if keep:
        lines = lines[:keep] + ["…"] * (len(lines) > keep)
    text = f"$ {command}\n" + "\n".join(lines) + "\n"
    if done.returncode not in (0,):
        text += f"(exit code {done.returncode})\n"
    print(f"{command}: {time.monotonic() - start:.0f} s, exit {done.returncode}", file=sys.stderr)
    if done.returncode not in (0, 1):
        print(done.stderr[-2000:], file=sys.stderr)
    return text


def machine() -> str:
    import platform

    import torch

    from dtypelab.core.machine.hardware import probe
    from dtypelab.core.version import __version__

    hw = probe(budget_s=0.05)
    return (f"{hw.cpu_name} ({', '.join(hw.cpu_flags) or 'no relevant flags'}), {hw.threads} threads; "
            f"torch {torch.__version__}, dtypelab {__version__}, Python {platform.python_version()}; "
            f"{time.strftime('%Y-%m-%d')}\n")


GPU_RECORDS = ("train", "forecast", "infer", "autopilot", "local-gpus")  # scripts/gpu/check's, in its order


def gpu_records(results: str) -> str:
    """The GPU guide's section of records: per GPU folder, the check's summary (device, torch, Python, date, commit,
    one line per part) and each record as ``dtypelab show`` renders it."""
    gpus = sorted(d for d in os.listdir(results) if os.path.isdir(os.path.join(results, d))) \
        if os.path.isdir(results) else []
    if not gpus:
        return ("No GPU has returned records yet. When one is lent, `scripts/gpu/check` measures them and "
                "`scripts/gpu/collect` files them under `benchmarks/results/<gpu>/`; this section is made from "
                "there.\n")
    out = []
    for gpu in gpus:
        folder = os.path.join(results, gpu)
        rel = os.path.relpath(folder, ROOT) if folder.startswith(ROOT) else folder
        summary = ""
        if os.path.exists(os.path.join(folder, "summary.txt")):
            with open(os.path.join(folder, "summary.txt")) as f:
                summary = f.read().strip()
        device = summary.splitlines()[0].removeprefix("device: ") if summary else gpu
        out.append(f"### {device.split(';')[0]}\n\nFrom `{rel}/`, as `scripts/gpu/check` wrote them "
                   f"({'; '.join(device.split('; ')[1:]) or 'no summary'}).\n\n```\n{summary}\n```\n")
        for name in GPU_RECORDS:
            record = os.path.join(folder, f"{name}.json")
            if os.path.exists(record):
                shown = run(f"dtypelab show {os.path.relpath(record, ROOT) if record.startswith(ROOT) else record}")
                out.append(f"#### {name}\n\n```\n{shown}```\n")
    return "\n".join(out)


def readme(name: str, text: str) -> None:
    """Rewrite the README's block between ``<!-- sample:NAME -->`` and ``<!-- /sample -->``."""
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        readme_text = f.read()
    block = re.compile(rf"(<!-- sample:{re.escape(name)} -->\n```\n).*?(```\n<!-- /sample -->)", re.S)
    if block.search(readme_text):
        with open(path, "w") as f:
            f.write(block.sub(lambda m: m.group(1) + text + m.group(2), readme_text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="sample names (see --list); cli for the CLI reference")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join([*COMMANDS, "cli", "machine", "gpu"]))
        return
    os.makedirs(SAMPLES, exist_ok=True)
    wanted = set(args.only or [*COMMANDS, "cli", "machine", "gpu"])
    if "machine" in wanted:
        with open(os.path.join(SAMPLES, "machine.txt"), "w") as f:
            f.write(machine())
    for name, (command, keep) in COMMANDS.items():
        if name in wanted:
            text = run(command, keep)
            with open(os.path.join(SAMPLES, f"{name}.txt"), "w") as f:
                f.write(text)
            readme(name, text)
    if any(n.startswith("forecast") for n in wanted & set(COMMANDS)):  # made on another day than machine.txt's
        with open(os.path.join(SAMPLES, "forecast-machine.txt"), "w") as f:
            f.write(machine())
    if any(n.startswith(("generate", "energy")) for n in wanted & set(COMMANDS)):
        with open(os.path.join(SAMPLES, "generate-machine.txt"), "w") as f:
            f.write(machine())
    if "gpu" in wanted:  # the committed GPU records (scripts/gpu/check, collect), re-rendered: no GPU needed here
        with open(os.path.join(SAMPLES, "gpu-records.md"), "w") as f:
            f.write(gpu_records(os.path.join(ROOT, "benchmarks", "results")))
    if "cli" in wanted:
        for cmd in CLI:
            with open(os.path.join(SAMPLES, f"cli-{cmd}.txt"), "w") as f:
                f.write(run(f"dtypelab {cmd} --help"))


if __name__ == "__main__":
    main()
