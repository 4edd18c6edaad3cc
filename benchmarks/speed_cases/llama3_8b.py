"""Llama-3-8B's shape (32 layers, d=4096, 32 heads with 8 for keys and values, SwiGLU 14336, 128,256-token
vocabulary) at 8192 tokens, batch 1 per GPU: the model of torchao's float8 training table (its README, "Training
benchmarks": torchtitan, 8×H100, FSDP2, torch.compile, per-op selective activation checkpointing). Built from its
shape alone, for forecasts."""

from dtypelab.core.tasks.decoder import Shape, _task

LLAMA3_8B = Shape("llama3-8b", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, seq=8192,
                  batch=1, steps=10, lr=3e-4)


def make_task():
    return _task(LLAMA3_8B, "Llama-3-8B's shape at 8192 tokens (torchao's float8 training benchmark)")
