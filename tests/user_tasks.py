"""Task files written the way a new user writes them (built-in modules, a torch loss function, idioms the lint
rules know), for the trace tests of source lines and root causes. Line numbers matter: tests read them."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

import dtypelab

X = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
Y = X.sum(1, keepdim=True)


def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(X), (batch_size,), generator=g)
    return X[idx], Y[idx]


def sgd_blowup() -> dtypelab.Task:
    """Built-in modules only, a torch loss function, SGD at lr=1e6: the weights explode within 3 steps."""
    return dtypelab.Task(
        name="sgd-blowup",
        make_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),  # MODEL LINE
        train_batch=batch,
        loss_fn=F.mse_loss,  # LOSS LINE
        evaluate=lambda predict: {"mse": F.mse_loss(predict(X), Y).item()},
        metric="mse", higher_is_better=False,
        make_optimizer=lambda p: torch.optim.SGD(p, lr=1e6),
        steps=20, batch_size=32,
    )


def _variant(model: type[nn.Module], lr: float = 0.0) -> dtypelab.Task:
    return dataclasses.replace(sgd_blowup(), make_model=model, make_optimizer=lambda p: torch.optim.SGD(p, lr=lr))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 1000


def loss_overflow() -> dtypelab.Task:
    """Outputs up to ~1e3: their squares overflow float16 inside F.mse_loss."""
    return _variant(Scaled)


class LogSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x) * 300
        return torch.log(torch.softmax(z, -1)).sum(-1, keepdim=True)  # LOGSOFTMAX LINE


def log_softmax() -> dtypelab.Task:
    return _variant(LogSoftmax)


class Cat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, torch.log(x)], dim=-1))  # CAT LINE


def brackets() -> dtypelab.Task:
    """log of negatives on a line full of square brackets, which rich would read as markup."""
    return _variant(Cat)


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
        with torch.no_grad():
            self.net[0].weight.fill_(1.0)  # eight positive terms of ~1e38 add up past float32's max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.abs() * 1e38)  # WRAPPER LINE


def via_module() -> dtypelab.Task:
    """The overflow happens inside a built-in Linear called from the user's forward."""
    return _variant(Wrapper)


def minilm_8_pairs() -> dtypelab.Task:
    """The built-in minilm task scored on its first 8 paraphrase pairs (one small eval batch instead of four): where
    torchao's int8 matmul runs torch's own loop (AVX2 without VNNI, 1-3 GFLOP/s), the full set costs a test a
    minute."""
    from dtypelab.core.tasks import minilm

    task = minilm.make_task()
    ids, mask = minilm._encoded()
    n, k = len(ids) // 2, 8
    pick = torch.cat([torch.arange(k), n + torch.arange(k)])
    cut = _trimmed({"input_ids": ids, "attention_mask": mask})  # 128 tokens of padding for 23 real: 5x the work
    ids, mask = cut["input_ids"], cut["attention_mask"]

    def infer_batch(b: int) -> dict[str, torch.Tensor]:
        idx = torch.arange(b) % len(ids)
        return {"input_ids": ids[idx], "attention_mask": mask[idx]}

    def evaluate(predict):
        emb = predict({"input_ids": ids[pick], "attention_mask": mask[pick]})
        return {"recall@1": minilm.recall_at_1(emb), "pair_cosine": (emb[:k] * emb[k:]).sum(1).mean().item()}

    return dataclasses.replace(task, evaluate=evaluate, infer_batch=infer_batch)


def _trimmed(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of token rows cut after its longest row's last real token (the padding to 64 is work for nothing)."""
    longest = int(inputs["attention_mask"].sum(1).max())
    return {k: v[:, :longest] for k, v in inputs.items()}


def minilm_ft_small() -> dtypelab.Task:
    """minilm-ft at batch 4, its batches cut to their longest pair: a bfloat16 step of the whole MiniLM runs ~100x
    float32's on an AVX2-only CPU (no native bfloat16), and the task's batch of 16 pairs of 64 tokens cost a test
    five minutes there."""
    from dtypelab.core.tasks.pairs import make_minilm_finetune

    task = make_minilm_finetune()

    def train_batch(step: int, n: int):
        inputs, labels = task.train_batch(step, n)
        return _trimmed(inputs), labels

    def evaluate(predict):
        return task.evaluate(lambda inputs: predict(_trimmed(inputs)))

    return dataclasses.replace(task, train_batch=train_batch, evaluate=evaluate, batch_size=4)
