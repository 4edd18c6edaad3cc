"""FLOPs of the matmul / conv / attention ops a profiler recorded, from their input shapes, with the formulas
of torch.utils.flop_counter (the ones FlopCounterMode uses: 2 FLOPs per multiply-add)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.utils.flop_counter as fc

Shapes = Sequence[Sequence[int]]


def _conv(shapes: Shapes, args: Sequence[Any]) -> int:
    # aten::convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x, w = list(shapes[0]), list(shapes[1])
    stride, padding, dilation, transposed = args[3], args[4], args[5], bool(args[6])
    if transposed:  # the formula reads the input's spatial size then
        return fc.conv_flop_count(x, w, x, transposed=True)
    spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
               for size, k, s, p, d in zip(x[2:], w[2:], stride, padding, dilation, strict=True)]
    return fc.conv_flop_count(x, w, [x[0], w[0], *spatial])


def _conv_backward(shapes: Shapes, args: Sequence[Any]) -> int:
    # aten::convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #                            output_padding, groups, output_mask)
    x, w = list(shapes[1]), list(shapes[2])  # the gradients' shapes are the input's and the weight's
    return fc.conv_backward_flop(list(shapes[0]), x, w, None, None, None, None, bool(args[7]), None, None,
                                 list(args[10]), out_val=(x, w, None))


def _sdpa_backward(shapes: Shapes, args: Sequence[Any]) -> int:
    return fc.sdpa_backward_flop(*(list(s) for s in shapes[:4]))


# op name -> FLOPs from (input shapes, concrete inputs). A nested op under one of these is not counted again.
FORMULAS = {
    "aten::mm": lambda s, a: fc.mm_flop(s[0], s[1]),
    "aten::_int_mm": lambda s, a: fc.mm_flop(s[0], s[1]),
    "aten::_scaled_mm": lambda s, a: fc.mm_flop(s[0], s[1]),
    "aten::addmm": lambda s, a: fc.addmm_flop(s[0], s[1], s[2]),
    "aten::bmm": lambda s, a: fc.bmm_flop(s[0], s[1]),
    "aten::baddbmm": lambda s, a: fc.baddbmm_flop(s[0], s[1], s[2]),
    "aten::convolution": _conv,
    "aten::convolution_backward": _conv_backward,
    **{f"aten::_scaled_dot_product_{kind}": (lambda s, a: fc.sdpa_flop(s[0], s[1], s[2]))
       for kind in ("flash_attention", "flash_attention_for_cpu", "efficient_attention", "cudnn_attention")},
    **{f"aten::_scaled_dot_product_{kind}_backward": _sdpa_backward
       for kind in ("flash_attention", "flash_attention_for_cpu", "efficient_attention", "cudnn_attention")},
}


def op_flops(name: str, shapes: Shapes, concrete: Sequence[Any]) -> int | None:
    """FLOPs of one call of a counted op, None for any other op (or shapes the formula cannot read)."""
    formula = FORMULAS.get(name)
    if formula is None:
        return None
    try:
        return int(formula(shapes, concrete))
    except (IndexError, TypeError, ValueError, AssertionError):
        return None  # an overload with other arguments: better uncounted than wrong
