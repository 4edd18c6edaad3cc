"""A Hugging Face Trainer on a tiny BERT built from a config (no download): does a sequence contain token 7?
examples/plain/train_hf.py is it as written; examples/train_hf.py is the same with the lines dtypelab needs
(`dtypelab bench examples/train_hf.py -p fp32,amp-bf16 -- --epochs 2`; needs dtypelab[hf])."""

import argparse
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=float, default=2)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
ids = torch.randint(10, 100, (1200, 24))
labels = (torch.rand(1200) < 0.5).long()
ids[labels == 1, torch.randint(1, 24, (int(labels.sum()),))] = 7  # the positive class contains token 7
mask = torch.ones(24, dtype=torch.long)
data = [{"input_ids": i, "attention_mask": mask, "labels": y} for i, y in zip(ids, labels, strict=True)]

config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(config)


def accuracy(prediction):
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


training = TrainingArguments(output_dir=tempfile.mkdtemp(), num_train_epochs=args.epochs, learning_rate=3e-3,
                             per_device_train_batch_size=32, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=args.seed)
trainer = Trainer(model=model, args=training, train_dataset=data[:1000], eval_dataset=data[1000:],
                  compute_metrics=accuracy)
trainer.train()
print(trainer.evaluate())
