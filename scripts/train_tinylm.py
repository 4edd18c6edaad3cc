"""Rebuild src/dtypelab/core/tasks/data/tinylm: the small pretrained causal language model the ``tinylm`` task serves.

A Llama (RMSNorm, rotary positions, grouped-query attention: 4 query heads over 2 key/value heads, SwiGLU), 4 layers,
width 128, over bytes (a 256-token vocabulary: no tokenizer to ship), trained here on Python's own reference
documentation (``pydoc_data.topics``, PSF License). Its held-out text is the CPython docstrings the charlm task ships
(``data/corpus.txt``), which it never sees. Run this only to regenerate the model (about ten minutes on two cores):

    python scripts/train_tinylm.py
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import torch

OUT = pathlib.Path(__file__).resolve().parent.parent / "src/dtypelab/core/tasks/data/tinylm"
SEQ, BATCH, STEPS, LR = 256, 16, 900, 3e-3


def corpus() -> torch.Tensor:
    import pydoc_data.topics as topics

    text = "\n\n".join(v for _, v in sorted(topics.topics.items()))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def main() -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    data = corpus()
    model = LlamaForCausalLM(config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.perf_counter()
    for step in range(STEPS):
        lr = LR * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        for group in opt.param_groups:
            group["lr"] = lr
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        ids = data[starts[:, None] + torch.arange(SEQ + 1)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == STEPS - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "float32"
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "TRAINING.json").write_text(json.dumps({
        "corpus": "pydoc_data.topics (Python's reference documentation, PSF License), UTF-8 bytes",
        "bytes": len(data), "seq": SEQ, "batch": BATCH, "steps": STEPS, "lr": LR,
        "final_loss": round(loss.item(), 4), "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
