"""The rule catalogue: each rule's code, name, why it is a hazard, and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    why: str
    fix: str


RULES = {r.code: r for r in (
    Rule("DTL001", "naive-softmax", "exp(x) / sum(exp(x)) overflows for large x (exp(x) is inf above 88.7 in "
         "float32, 11.1 in float16) and gives NaN", "use torch.softmax(x, dim), or subtract x.amax(dim, "
         "keepdim=True) before exp"),
    Rule("DTL002", "log-of-softmax", "log(softmax(x)) is -inf once a probability underflows to 0",
         "use torch.log_softmax(x, dim) (F.log_softmax)"),
    Rule("DTL003", "log-sum-exp", "log(sum(exp(x))) overflows for large x", "use torch.logsumexp(x, dim)"),
    Rule("DTL004", "log1p", "log(1 + x) loses x when |x| is below eps (1 + 1e-8 == 1 in float32)", "use log1p(x)"),
    Rule("DTL005", "expm1", "exp(x) - 1 cancels catastrophically for small |x|", "use expm1(x)"),
    Rule("DTL006", "nan-equality", "a comparison with NaN is always False (!= always True)",
         "use torch.isnan(x) / math.isnan(x)"),
    Rule("DTL007", "log-of-sigmoid", "log(sigmoid(x)) is -inf once sigmoid underflows (x below -88 in float32, "
         "-17 in float16)", "use F.logsigmoid(x)"),
    Rule("DTL101", "backward-in-autocast", ".backward() inside an autocast block: autocast should cover only "
         "the forward pass and the loss", "end the `with autocast` block before calling .backward()"),
    Rule("DTL102", "half-model-training", "the whole model is converted to float16 and then trained: updates "
         "smaller than the weights' eps are lost, gradients underflow, and Adam's eps=1e-8 is 0 in float16",
         "keep float32 weights; use torch.autocast(device, dtype=torch.float16) and torch.amp.GradScaler"),
    Rule("DTL103", "sigmoid-bce", "sigmoid + BCELoss: log of a saturated sigmoid is -inf, and autocast rejects "
         "BCELoss on CUDA", "drop the sigmoid and use nn.BCEWithLogitsLoss / F.binary_cross_entropy_with_logits"),
    Rule("DTL104", "gradscaler-with-bf16", "GradScaler with bfloat16 autocast: bfloat16 has float32's exponent "
         "range, so loss scaling only costs time", "drop the GradScaler: loss.backward(); optimizer.step()"),
    Rule("DTL105", "deprecated-amp-api", "torch.cuda.amp.* and torch.cpu.amp.* are deprecated",
         "use torch.amp.autocast('cuda', ...), torch.amp.GradScaler('cuda'), torch.amp.custom_fwd(device_type=…)"),
    Rule("DTL106", "float64-promotion", "NumPy makes float64 by default and torch keeps it: the tensor is float64, "
         "and every float32 tensor it meets is promoted to float64 (2x slower on a CPU, up to 64x on a GPU)",
         "convert once: torch.from_numpy(a).float(), torch.as_tensor(a, dtype=torch.float32), or build the array "
         "with dtype=np.float32"),
    Rule("DTL107", "explicit-float64", ".double() makes float64 work: 2x slower than float32 on a CPU and up to "
         "64x on consumer GPUs, and it promotes every tensor it meets",
         "keep float32 unless this is a deliberate float64 reference (then: # dtypelab: ignore[DTL107])"),
    Rule("DTL108", "default-dtype-later", "a float tensor made before torch.set_default_dtype(torch.float64) stays "
         "float32 while everything made after is float64: mixing them promotes or fails",
         "give the early tensor an explicit dtype, or set the default dtype before creating any tensor"),
    Rule("DTL109", "broadcast-loss", "a (N, 1) column against a (N,) vector broadcasts to (N, N): the loss or mean "
         "runs over N² pairs and silently trains on the wrong objective",
         "make both the same shape: squeeze the column (x.squeeze(1)) or unsqueeze the vector (y.unsqueeze(1))"),
    Rule("DTL110", "fixed-dtype-in-forward", "a tensor made inside forward with a fixed floating dtype does not "
         "follow the model's precision: under weights of another dtype (float32, bfloat16) it meets them and the "
         "op fails or promotes", "follow the input: dtype=x.dtype, device=x.device (or x.new_zeros(...))"),
    Rule("DTL900", "unparsable", "the file could not be parsed, so it was not checked",
         "fix the syntax error or the encoding"),
)}
