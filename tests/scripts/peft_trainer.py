"""A Hugging Face Trainer fine-tuning a peft model the script makes itself (LoRA on q_proj and v_proj of a two-layer
Llama built from a config, no download), on sequences whose next token is the last one plus one: dtypelab's tests
run it alone and under `dtypelab bench` with base precisions (its own adapters kept)."""

import argparse
import json
import os
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

torch.manual_seed(0)
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "..", "..", "benchmarks", "configs", "tiny-llama", "config.json")) as f:
    config = LlamaConfig(**{k: v for k, v in json.load(f).items() if k != "architectures"})
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
starts = torch.randint(0, 400, (160,))
ids = (starts[:, None] + torch.arange(16)) % 512
data = [{"input_ids": i, "labels": i} for i in ids]
training = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=1e-3,
                             per_device_train_batch_size=8, save_strategy="no", report_to=[], disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available(), seed=0)
trainer = dtypelab.hf.Trainer(model=model, args=training, train_dataset=data[:128], eval_dataset=data[128:],
                              metric="eval_loss", higher_is_better=False)
trainer.train()
print(trainer.evaluate())
