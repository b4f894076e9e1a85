"""Weights in their own format (worker.model.weights / formats, csrc/qlinear.cpp): the native
kernel against dequantize-then-F.linear on every SmolLM2 layer shape, format and row count (for
Q8_0 / Q4_*, whose kernel takes x quantized to int8 per block of 32, within that quantization's
bound: `_xq_bound`); the
GGUF reader against transformers' dequantization and the gguf package; the quantizers against
ggml's (the gguf package's numpy port); the engine on each format against HF transformers."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker.kernels import native
from worker.model.linear import GatedLinear, Linear
from worker.model.weights import (
    Bf16Weight,
    QuantRows,
    WeightFormat,
    dense,
    from_gguf_blocks,
    pack,
    quantize,
)

FORMATS = [WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.BF16]
# SmolLM2-135M: fused q/k/v, o_proj, down_proj, lm_head (tied embedding); the gate/up pair below
SHAPES = [(960, 576), (576, 576), (576, 1536), (49152, 576), (40, 64)]
GGML = {WeightFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0, WeightFormat.Q4_0: gguf.GGMLQuantizationType.Q4_0,
        WeightFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1}
EPS32 = torch.finfo(torch.float32).eps


def _weight(n: int, k: int, fmt: WeightFormat, seed: int) -> QuantRows | Bf16Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return Bf16Weight(w.bfloat16()) if fmt is WeightFormat.BF16 else quantize(w, fmt)


def _close(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, k: int,
           xq: torch.Tensor | float = 0.0) -> None:
    """`out` (fp32 sums in the kernel's order) within fp32 rounding of the float64 `ref`: per
    output, sqrt(k) eps of the sum of the absolute terms (`abs_sum`), the scale of the rounding
    error of a k-term fp32 dot product, plus `xq`, the bound of the activation's int8 quantization
    (`_xq_bound`); a wrong block, scale or row is off by orders more."""
    err = (out.double() - ref).abs()
    bound = k**0.5 * EPS32 * abs_sum + EPS32 * ref.abs() + xq
    assert (err <= bound).all(), (err - bound).max().item()


def _xq_bound(x: torch.Tensor, w_abs: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """What quantizing x to int8 per block of 32 (scale max|x| / 127, codes rounded to nearest) can
    move x Wᵀ by, [M, N]: each x_k moves by at most half a step, max_block |x| / 254, so output n
    by at most sum_k |W_nk| max_block(k) |x| / 254 (0 for bf16, whose kernel keeps x fp32)."""
    if not fmt.quantized:
        return torch.zeros(x.shape[0], w_abs.shape[0], dtype=torch.float64)
    m, k = x.shape
    step = x.double().abs().view(m, k // 32, 32).amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k) / 254
    return F.linear(step, w_abs) * (1 + 1e-5)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) * 7919 + len(shape)))


pytestmark = pytest.mark.skipif(not native.qlinear_isa(), reason="the native kernels are not built here")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_dequantized_f_linear(fmt: WeightFormat, shape: tuple[int, int]) -> None:
    """Batch 1, 2, 5 and 16 (decode) and 40 rows (a prefill), with bias, residual and the fused norm."""
    n, k = shape
    w = _weight(n, k, fmt, n + k)
    b = _randn(n)
    lin = Linear(w, b)
    assert lin.qweight is not None and lin.packed is None and lin.weight.numel() == 0, "no fp32 copy is kept"
    ref_w, bias = dense(w).double(), b.double()
    norm = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5
    for m in ([1, 16] if n * k > 10**7 else [1, 2, 5, 16, 40]):
        x, residual = _randn(m, k), _randn(m, n, 1)[..., 0]
        abs_sum = F.linear(x.double().abs(), ref_w.abs(), bias.abs())
        xq = _xq_bound(x, ref_w.abs(), fmt)
        _close(lin(x), F.linear(x.double(), ref_w, bias), abs_sum, k, xq)
        _close(lin.add_to(residual, x), residual.double() + F.linear(x.double(), ref_w, bias),
               abs_sum + residual.double().abs(), k, xq)
        normed = (norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))).double()
        _close(lin.normed(x, norm, 1e-5), F.linear(normed, ref_w, bias),
               F.linear(normed.abs(), ref_w.abs(), bias.abs()), k, _xq_bound(normed, ref_w.abs(), fmt))


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the Q8_0 / Q4_* kernel takes it: per row and block of 32, scale max|x| / 127 and codes
    round-half-even(x * 127 / max|x|) (fp32, as csrc/qlinear.cpp's quantize_x), dequantized."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).clamp(-127, 127) * (amax / 127)).view(m, k)


@pytest.mark.parametrize("fmt", [WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1], ids=lambda f: f.value)
def test_quantized_kernel_is_w_times_the_int8_x(fmt: WeightFormat) -> None:
    """The integer-dot kernel computes exactly W x̂ for the int8-quantized x̂ (within fp32
    rounding of that product, no quantization slack): block scales, the Q8_0 + 128 offset and the
    4-bit offsets' sum term are all accounted for."""
    for n, k in ((960, 576), (40, 64)):
        w = _weight(n, k, fmt, n * k)
        lin = Linear(w)
        ref_w = dense(w).double()
        for m in (1, 5, 16):
            xh = _quantized_x(_randn(m, k)).double()
            _close(lin(_randn(m, k)), F.linear(xh, ref_w), F.linear(xh.abs(), ref_w.abs()), k)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_gated_mlp_kernel_matches_reference(fmt: WeightFormat) -> None:
    gate, up = _weight(1536, 576, fmt, 1), _weight(1536, 576, fmt, 2)
    mlp = GatedLinear(gate, up)
    assert mlp.qgated
    for m in (1, 16, 33):
        x = _randn(m, 576).double()
        g, u = F.linear(x, dense(gate).double()), F.linear(x, dense(up).double())
        g_abs, u_abs = F.linear(x.abs(), dense(gate).double().abs()), F.linear(x.abs(), dense(up).double().abs())
        gq, uq = _xq_bound(x, dense(gate).double().abs(), fmt), _xq_bound(x, dense(up).double().abs(), fmt)
        # silu' <= 1.1: an error e_g of g moves silu(g) u by at most 1.1 |u| e_g (and e_u by |silu(g)| e_u)
        _close(mlp(x.float()), F.silu(g) * u, 1.1 * u.abs() * g_abs + F.silu(g).abs() * u_abs, 576,
               1.1 * (u.abs() + uq) * gq + F.silu(g).abs() * uq)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_embedding_rows_are_the_dequantized_rows(fmt: WeightFormat) -> None:
    w = _weight(100, 64, fmt, 3)
    lin = Linear(w)
    ids = torch.tensor([0, 15, 16, 99, 42, 42])
    assert torch.equal(lin.rows(ids), dense(w)[ids])


@pytest.mark.parametrize("fmt", [WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1], ids=lambda f: f.value)
def test_quantizer_and_block_reader_agree_with_ggml(fmt: WeightFormat) -> None:
    """Our quantizer gives ggml's blocks (the gguf package's port of quantize_row_*_ref, but for
    rounding ties), and our block reader dequantizes them as the gguf package does."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    raw = gguf.quants.quantize(w.numpy(), GGML[fmt])                   # [64, bytes]
    rows = from_gguf_blocks(fmt, torch.from_numpy(raw), 256)
    expected = gguf.quants.dequantize(raw, GGML[fmt])
    assert np.array_equal(rows.dequantize().numpy(), expected)
    ours = quantize(w, fmt)
    assert torch.equal(ours.d, rows.d)
    assert (ours.q != rows.q).float().mean() < 1e-3


def test_bytes_per_weight_of_the_packed_layout() -> None:
    w = torch.randn(32, 64)
    for fmt, bits in ((WeightFormat.Q8_0, 8.5), (WeightFormat.Q4_1, 5.0), (WeightFormat.BF16, 16.0)):
        packed = pack(quantize(w, fmt) if fmt.quantized else Bf16Weight(w.bfloat16()), fmt)
        assert packed.nbytes * 8 == bits * w.numel() == fmt.bits_per_weight * w.numel()


def test_avx2_path_matches_too() -> None:
    """The AVX2 + FMA + F16C kernel (chosen where AVX-512 VNNI is missing), forced in a child process:
    the activation's int8 quantization bound (`_xq_bound`) for Q8_0 / Q4_1, fp32 rounding for bf16."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from worker.kernels import native\n"
        "from worker.model.weights import WeightFormat, quantize, pack, Bf16Weight, dense\n"
        "assert native.qlinear_isa() == 'avx2'\n"
        "for fmt in (WeightFormat.Q8_0, WeightFormat.Q4_1, WeightFormat.BF16):\n"
        "    w = torch.randn(96, 128)\n"
        "    q = quantize(w, fmt) if fmt.quantized else Bf16Weight(w.bfloat16())\n"
        "    p = pack(q, fmt)\n"
        "    for m in (1, 3, 16):\n"
        "        x = torch.randn(m, 128)\n"
        "        ref = F.linear(x.double(), dense(q).double())\n"
        "        step = x.double().abs().view(m, 4, 32).amax(-1, keepdim=True).expand(m, 4, 32).reshape(m, 128) / 254\n"
        "        bound = F.linear(step, dense(q).double().abs()) if fmt.quantized else 0\n"
        "        out = native.qlinear(x, p.data, fmt.kernel_code, 96)\n"
        "        assert ((out.double() - ref).abs() <= bound + 1e-5 * ref.abs().max()).all(), fmt\n"
        "print('ok')\n")
    env = dict(os.environ, KVMESH_QLINEAR_ISA="avx2")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
