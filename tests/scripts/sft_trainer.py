"""TRL's SFTTrainer fine-tuning a two-layer Llama (built from a config, no download) with a LoRA ``peft_config`` on
q_proj and v_proj, on pre-tokenized sequences whose next token is the last one plus one, with a word-level tokenizer
made here: dtypelab's tests run it alone and under `dtypelab bench` (the adapters SFTTrainer would make, kept)."""

import argparse
import json
import os
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig

import dtypelab

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

torch.manual_seed(0)
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "..", "..", "benchmarks", "configs", "tiny-llama", "config.json")) as f:
    config = LlamaConfig(**{k: v for k, v in json.load(f).items() if k != "architectures"}, pad_token_id=0,
                         eos_token_id=1)
model = LlamaForCausalLM(config)
words = {f"w{i}": i for i in range(config.vocab_size)}
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="w2")), pad_token="w0",
                                    eos_token="w1", unk_token="w2")
starts = torch.randint(3, 400, (160,))
ids = ((starts[:, None] + torch.arange(16)) % 509 + 3).tolist()
data = Dataset.from_dict({"input_ids": ids})
training = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=1e-3,
                     per_device_train_batch_size=8, save_strategy="no", report_to=[], disable_tqdm=True,
                     use_cpu=not torch.cuda.is_available(), seed=0, max_length=16, packing=False)
trainer = dtypelab.hf.SFTTrainer(model=model, args=training, train_dataset=data.select(range(128)),
                                 eval_dataset=data.select(range(128, 160)), processing_class=tokenizer,
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                                 metric="eval_loss", higher_is_better=False)
trainer.train()
print("trainable", sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))
print(trainer.evaluate())
