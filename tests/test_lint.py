"""lint: every rule has cases it must flag and cases it must leave alone (a false positive is a bug)."""

from __future__ import annotations

import json
import textwrap

import pytest

from dtypelab import DtypelabError, lint_paths, lint_source
from dtypelab.lint import RULES, select_rules

HEADER = """\
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
"""


def codes(src: str, header: str = HEADER) -> list[str]:
    found, _ = lint_source(header + textwrap.dedent(src))
    return [f.code for f in found]


POSITIVE = {
    "DTL001": ["y = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)",
               "e = x.exp()\ny = e / e.sum(dim=1, keepdim=True)",
               "y = np.exp(x) / np.sum(np.exp(x))",
               "e = torch.exp(x)\ns = torch.sum(e, 1)\ny = e / s"],
    "DTL002": ["y = torch.log(F.softmax(x, dim=-1))", "y = x.softmax(-1).log()",
               "p = torch.softmax(x, 1)\ny = torch.log(p)", "y = torch.log(nn.Softmax(dim=1)(x))"],
    "DTL003": ["y = torch.log(torch.sum(torch.exp(x), dim=0))", "y = x.exp().sum(-1).log()",
               "y = np.log(np.sum(np.exp(x)))"],
    "DTL004": ["y = torch.log(1 + x)", "y = math.log(1.0 + p)", "y = (x + 1).log()", "y = np.log(x + 1)",
               "y = torch.log(1 + torch.exp(x))"],
    "DTL005": ["y = torch.exp(x) - 1", "y = x.exp() - 1.0", "y = math.exp(p) - 1"],
    "DTL006": ["b = x == float('nan')", "b = x != math.nan", "b = np.nan == x", "b = x is torch.nan",
               "b = x == float('NaN')"],
    "DTL007": ["y = torch.log(torch.sigmoid(x))", "y = x.sigmoid().log()"],
    "DTL101": ["with torch.autocast('cuda'):\n    loss = model(x)\n    loss.backward()",
               "with torch.amp.autocast('cuda', dtype=torch.float16):\n    scaler.scale(loss).backward()",
               "with torch.autocast('cpu', dtype=torch.bfloat16):\n    if ok:\n        torch.autograd.backward(loss)"],
    "DTL102": ["model = Net().half()\nopt = torch.optim.Adam(model.parameters())",
               "model.half()\nmodel.train()",
               "net = net.to(torch.float16)\noptimizer = torch.optim.SGD(net.parameters(), lr=0.1)",
               "self.model.to(dtype=torch.half)\nopt = torch.optim.AdamW(self.model.parameters())",
               "class L:\n    def __init__(self):\n        self.net = Net().half()\n"
               "    def configure(self):\n        return torch.optim.Adam(self.net.parameters())",
               # a parameter converted, then called and backpropagated through in the same function
               "def train(model, loader, opt):\n    model = model.half()\n    for x, y in loader:\n"
               "        loss = F.cross_entropy(model(x), y)\n        loss.backward()\n        opt.step()"],
    "DTL103": ["crit = nn.BCELoss()\nout = torch.sigmoid(h)",
               "loss = F.binary_cross_entropy(torch.sigmoid(z), y)",
               "head = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())\nloss_fn = torch.nn.BCELoss()"],
    "DTL104": ["scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n    pass",
               "scaler = torch.GradScaler()\nwith torch.autocast(device_type='cpu'):\n    pass"],
    "DTL105": ["with torch.cuda.amp.autocast():\n    pass", "scaler = torch.cuda.amp.GradScaler()",
               "from torch.cuda.amp import GradScaler", "with torch.cpu.amp.autocast():\n    pass"],
    "DTL106": ["w = np.random.randn(3, 3)\nt = torch.from_numpy(w)", "t = torch.tensor(np.array([0.1, 0.2]))",
               "t = torch.as_tensor(np.linspace(0, 1, 5))", "y = x * torch.from_numpy(np.zeros(4))"],
    "DTL107": ["y = x.double()", "ref = model(x.double())"],
    "DTL108": ["w = torch.tensor([0.5, 1.5])\ntorch.set_default_dtype(torch.float64)",
               "s = torch.tensor(-1.0)\ntorch.set_default_dtype(torch.double)"],
    "DTL109": ["loss = F.mse_loss(pred.view(-1, 1), y.squeeze())", "loss = F.l1_loss(p[:, 0], t.unsqueeze(1))",
               "loss = ((pred[:, None] - y.view(-1)) ** 2).mean()", "c = out.unsqueeze(-1)\nd = c - y.flatten()"],
    "DTL110": ["class S(nn.Module):\n    def forward(self, x):\n        h = torch.zeros(4, dtype=torch.double)",
               "def forward(self, x):\n    return x + torch.ones(3, dtype=torch.float32)",
               "class S(nn.Module):\n    def forward(self, x):\n        e = torch.eye(4, dtype=torch.bfloat16)"],
}

NEGATIVE = {
    "DTL001": ["e = torch.exp(x - x.max(dim=-1, keepdim=True).values)\ny = e / e.sum(-1, keepdim=True)",
               "m = helper_max(x)\ne = torch.exp(x - m)\ny = e / e.sum(1)",
               "y = torch.softmax(x, -1)", "y = torch.exp(x) / 2", "y = x / x.sum(-1)"],
    "DTL002": ["y = F.log_softmax(x, -1)", "y = torch.log(x)", "y = torch.log(self.softmax(x))"],
    "DTL003": ["y = torch.logsumexp(x, 0)", "m = x.amax(0)\ny = m + torch.log(torch.sum(torch.exp(x - m), 0))",
               "y = torch.log(torch.sum(x, 0))"],
    "DTL004": ["y = torch.log1p(x)", "y = torch.log(2 + x)", "y = math.log(1 + p, 10)", "y = torch.log(x)",
               "y = torch.log(1 - x)", "y = math.log(1 + 3)", "y = np.log(1 + 2 ** -3)"],
    "DTL005": ["y = torch.expm1(x)", "y = torch.exp(x) - 2", "y = 1 - torch.exp(x)", "y = x - 1"],
    "DTL006": ["b = torch.isnan(x)", "b = math.isnan(p)", "b = x == 0.0", "b = x != x", "b = name == 'nan'"],
    "DTL007": ["y = F.logsigmoid(x)", "y = torch.sigmoid(x)", "y = torch.log(x.clamp(min=1e-6))"],
    "DTL101": ["with torch.autocast('cuda'):\n    loss = model(x)\nloss.backward()",
               "with torch.autocast('cuda', enabled=False):\n    loss.backward()",
               "with torch.no_grad():\n    loss.backward()",
               "with torch.autocast('cuda'):\n    def later():\n        loss.backward()"],
    "DTL102": ["x = batch.half()", "model = Net().half()\nmodel.eval()\nout = model(x)",
               "model.half()\nmodel.train(False)", "y = x.to(torch.bfloat16)\nopt = torch.optim.SGD(y.parameters())",
               "def export(model):\n    model.half()\n    return model.state_dict()\n"
               "def fit(model):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)",
               # converted and called, but the backward belongs to another function
               "def infer(model, x):\n    model = model.half()\n    return model(x)\n"
               "def step(loss):\n    loss.backward()"],
    "DTL103": ["crit = nn.BCEWithLogitsLoss()\nout = torch.sigmoid(h)", "crit = nn.BCELoss()",
               "loss = F.binary_cross_entropy(p, y)", "loss = F.binary_cross_entropy_with_logits(z, y)"],
    "DTL104": ["scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda', dtype=torch.float16):\n    pass",
               "scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast('cuda'):\n    pass",
               "with torch.autocast('cuda', dtype=torch.bfloat16):\n    pass",
               "scaler = torch.amp.GradScaler('cuda')\nwith torch.autocast(dev, dtype=torch.bfloat16):\n    pass\n"
               "with torch.autocast(dev, dtype=torch.float16):\n    pass"],
    "DTL105": ["with torch.amp.autocast('cuda'):\n    pass", "scaler = torch.amp.GradScaler('cuda')",
               "from torch.amp import GradScaler", "import torch.cuda"],
    "DTL106": ["t = torch.from_numpy(np.random.randn(3)).float()",
               "t = torch.as_tensor(np.zeros(3), dtype=torch.float32)", "t = torch.from_numpy(np.array([1, 2]))",
               "t = torch.from_numpy(np.zeros(3, dtype=np.float32))", "t = torch.from_numpy(arr)"],
    "DTL107": ["y = x.float()", "y = x.to(torch.float32)", "y = torch.double"],
    "DTL108": ["w = torch.tensor([0.5])", "torch.set_default_dtype(torch.float64)\nw = torch.tensor([0.5])",
               "w = torch.tensor([1, 2])\ntorch.set_default_dtype(torch.float64)",
               "w = torch.tensor([0.5], dtype=torch.float32)\ntorch.set_default_dtype(torch.float64)"],
    "DTL109": ["loss = F.mse_loss(pred, y.unsqueeze(1))", "loss = F.mse_loss(pred.squeeze(1), y)",
               "loss = F.mse_loss(p.view(-1, 1), t.view(-1, 1))", "d = x[:, None] - y[None, :]"],
    "DTL110": ["def forward(self, x):\n    h = torch.zeros(x.size(0), 51, dtype=x.dtype)",
               "def forward(self, x):\n    i = torch.arange(4, dtype=torch.long)",
               "def make():\n    return torch.zeros(3, dtype=torch.double)", "h = torch.zeros(3, dtype=torch.double)"],
}


@pytest.mark.parametrize("code,src", [(c, s) for c, cases in POSITIVE.items() for s in cases])
def test_rule_flags(code, src):
    assert code in codes(src), src


@pytest.mark.parametrize("code,src", [(c, s) for c, cases in NEGATIVE.items() for s in cases])
def test_rule_leaves_alone(code, src):
    assert code not in codes(src), src


def test_every_rule_has_positive_and_negative_cases():
    assert set(POSITIVE) | {"DTL900"} == set(RULES) and set(NEGATIVE) | {"DTL900"} == set(RULES)


def test_import_aliases_are_resolved():
    assert codes("y = exp(x) / exp(x).sum()", "from torch import exp\n") == ["DTL001"]
    assert codes("y = th.log(Fn.softmax(x, 1))", "import torch as th\nfrom torch.nn import functional as Fn\n") == [
        "DTL002"]
    assert codes("y = lg(1 + x)", "from torch import log as lg\n") == ["DTL004"]
    assert codes("with autocast():\n    pass", "from torch.cuda.amp import autocast\n") == ["DTL105"]
    assert codes("y = log(1 + x)", "def log(v):\n    return v\n") == []  # not torch's log: unknown, left alone


def test_syntax_error_is_a_finding_not_a_crash(tmp_path):
    (tmp_path / "bad.py").write_text("def f(:\n    pass\n")
    (tmp_path / "latin.py").write_bytes(b"x = '\xff\xfe'\n")
    (tmp_path / "ok.py").write_text("import torch\ny = torch.log(1 + x)\n")
    r = lint_paths([str(tmp_path)])
    by_file = {f.path.rsplit("/", 1)[1]: f for f in r.findings}
    assert r.files == 3 and by_file["bad.py"].code == "DTL900" and by_file["bad.py"].line == 1
    assert by_file["latin.py"].code == "DTL900" and by_file["ok.py"].code == "DTL004"


def test_suppression_comments():
    src = HEADER + "y = torch.log(1 + x)  # dtypelab: ignore\nz = torch.log(1 + x)  # dtypelab: ignore[DTL001]\n" \
                   "w = torch.log(1 + x)  # dtypelab: ignore[DTL001, DTL004]\n"
    found, hidden = lint_source(src)
    assert [f.line for f in found] == [7] and hidden == 2
    assert lint_source("# dtypelab: ignore-file\n" + src)[0] == []


def test_select_and_ignore():
    assert select_rules("DTL1") == {c for c in RULES if c.startswith("DTL1")}
    assert select_rules(None, "naive-softmax,DTL9") == set(RULES) - {"DTL001", "DTL900"}
    with pytest.raises(DtypelabError, match="unknown rule 'DTL7'"):
        select_rules("DTL7")
    src = HEADER + "y = torch.log(1 + x)\nz = torch.exp(x) - 1\n"
    assert [f.code for f in lint_source(src, rules=select_rules("DTL005"))[0]] == ["DTL005"]


def test_directories_skip_hidden_and_virtualenvs(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.py").write_text("import torch\ny = torch.log(1 + x)\n")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("")
    (tmp_path / "venv" / "y.py").write_text("import torch\ny = torch.log(1 + x)\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import torch\ny = torch.log(1 + x)\n")
    r = lint_paths([str(tmp_path)])
    assert r.files == 1 and r.lines == 2 and len(r.findings) == 1
    with pytest.raises(DtypelabError, match="no such file"):
        lint_paths([str(tmp_path / "missing.py")])


def test_lint_cli(tmp_path):
    from test_cli import dtypelab

    f = tmp_path / "train.py"
    f.write_text(HEADER + "y = torch.log(1 + x)\n")
    run = dtypelab("lint", str(f))
    assert run.returncode == 1 and f"{f}:6:5: DTL004 [log1p]" in run.stdout and "fix: use torch.log1p(x)" in run.stdout
    assert "1 finding in 1 file" in run.stderr
    data = json.loads(dtypelab("lint", str(f), "--format", "json").stdout)
    assert data["findings"][0]["code"] == "DTL004"
    assert dtypelab("lint", str(f), "--ignore", "DTL004").returncode == 0
    bad = dtypelab("lint", str(f), "--select", "nonsense")
    assert bad.returncode == 2 and "unknown rule" in bad.stderr and "Traceback" not in bad.stderr
    assert "DTL105" in dtypelab("lint", "--list-rules").stdout
