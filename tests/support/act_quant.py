"""The HF oracle for quantized weights: HF transformers' forward with every linear layer's input
quantized to int8 as the engine's Q8_0 / Q4_* kernels quantize it (worker/kernels/csrc/qlinear.cpp,
`quantize_x`): per row and block of 32 inputs, scale max|x| / 127, codes round-half-even(x * 127 /
max|x|) clamped to [-127, 127], x̂ = scale * code. HF's weights are the dequantized ones (the
converted model dir holds them), so HF then computes W x̂ — what the engine's kernel computes — in
its own fp32 order: the two differ by fp32 rounding, plus a code step wherever that rounding moves
x * 127 / max|x| across a .5 boundary (as two computation paths of the engine would without its
path-stable numerics).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

BLOCK = 32


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> x̂, the int8 quantization the kernel applies, dequantized."""
    shape = x.shape
    xb = x.float().reshape(-1, shape[-1] // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv).clamp(-127, 127)        # torch.round: half to even, as nearbyint
    return (codes * (amax / 127.0)).reshape(shape).to(x.dtype)


@contextmanager
def int8_activations(model: Any) -> Iterator[None]:
    """Within the block, every torch.nn.Linear of `model` takes its input through `quantize_rows`."""
    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (quantize_rows(args[0]), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
