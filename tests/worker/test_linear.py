"""worker.model.linear.Linear: every row count's kernel (the native packed kernel, the torch row vector,
the padded W · xᵀ GEMM, F.linear) gives F.linear's result, on every weight shape the model uses."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import native
from worker.model.linear import GatedLinear, Linear, rms_norm

TOL = {"atol": 1e-4, "rtol": 1e-5}

# SmolLM2-135M: fused q/k/v, o_proj, fused gate/up, down_proj, lm_head (tied embedding)
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
# the tiny test models (hidden 64, GQA) and shapes off the 16-row panel and the 8-float vector
ODD_SHAPES = [(128, 64), (176, 64), (48, 40), (50, 37), (3, 5), (17, 1), (1, 16)]


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Linear built with the packed native kernel, or as on a machine without it."""
    if request.param == "torch":
        monkeypatch.setattr(native, "linear_supported", lambda weight: False)
    else:
        assert native.linear_supported(torch.empty(2, 2)), "the native kernels did not build"
    return str(request.param)


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(bias: bool, path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    lin = Linear(w, b)
    assert (lin.packed is not None) == (path == "native") and (lin.weight_t is None) == (path == "native")
    for m in range(1, max(Linear.MAX_SMALL_M, Linear.MAX_PACKED_M) + 9):
        x = torch.randn(m, 40, generator=gen)
        residual = torch.randn(m, 48, generator=gen)
        expected = F.linear(x, w, b)
        out = lin(x)
        assert out.shape == (m, 48) and out.is_contiguous()
        torch.testing.assert_close(out, expected, **TOL)
        torch.testing.assert_close(lin.add_to(residual, x), residual + expected, **TOL)
        # a strided input (a column slice) takes the same paths
        wide = torch.randn(m, 80, generator=gen)
        torch.testing.assert_close(lin(wide[:, ::2]), F.linear(wide[:, ::2], w, b), **TOL)


@pytest.mark.parametrize("shape", SMOLLM2_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_kernel_on_every_model_shape(shape: tuple[int, int], threads: int) -> None:
    """The packed kernel on each weight shape, every row count it serves (1..MAX_PACKED_M)
    for the layer shapes, with bias and residual, against F.linear."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    packed = native.pack_linear(w)
    assert packed.shape == (-(-n // 16), k, 16)
    rows = [1, 2, 3, 4, 7, 16] if n * k > 10**7 else range(1, Linear.MAX_PACKED_M + 1)
    for m in rows:
        x = torch.randn(m, k, generator=gen) / k ** 0.5   # outputs O(1), as after a norm
        residual = torch.randn(m, n, generator=gen)
        torch.testing.assert_close(native.packed_linear(x, packed, n), F.linear(x, w), **TOL)
        torch.testing.assert_close(native.packed_linear(x, packed, n, b, residual), residual + F.linear(x, w, b),
                                   **TOL)


@pytest.mark.parametrize("shape", [(1536, 576), (64, 40), (16, 3)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gated_and_normed_match_torch(shape: tuple[int, int], path: str, threads: int) -> None:
    """GatedLinear = silu(x W_gateᵀ) * (x W_upᵀ) and `normed` = the same after rms_norm, for
    every row count (packed kernel up to MAX_PACKED_M, the torch path above)."""
    inter, k = shape
    gen = torch.Generator().manual_seed(inter + k)
    gate, up = torch.randn(inter, k, generator=gen) / k ** 0.5, torch.randn(inter, k, generator=gen) / k ** 0.5
    norm_w = 1 + 0.1 * torch.randn(k, generator=gen)
    mlp = GatedLinear(gate, up)
    qkv = Linear(torch.cat([gate, up]))
    assert mlp.gated_kernel == (path == "native")
    for m in [1, 2, 3, 5, 6, 7, 16, 31, Linear.MAX_PACKED_M, Linear.MAX_PACKED_M + 3]:
        x = 3 * torch.randn(m, k, generator=gen)
        expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
        torch.testing.assert_close(mlp(x), expected, **TOL)
        h = rms_norm(x, norm_w, 1e-5)
        torch.testing.assert_close(mlp.normed(x, norm_w, 1e-5), F.silu(F.linear(h, gate)) * F.linear(h, up), **TOL)
        torch.testing.assert_close(qkv.normed(x, norm_w, 1e-5), F.linear(h, qkv.weight), **TOL)


def test_gated_kernel_with_bias_and_odd_width() -> None:
    """The kernel's gated epilogue adds the (interleaved) bias before the activation; an
    intermediate size off the 8-row group keeps the chunk path."""
    k, inter = 24, 32
    w = torch.randn(2 * inter, k)
    b = torch.randn(2 * inter)
    order = torch.arange(2 * inter).view(2, inter // 8, 8).transpose(0, 1).flatten()
    x = torch.randn(3, k)
    y = F.linear(x, w, b)
    out = native.packed_linear(x, native.pack_linear(w[order]), 2 * inter, b[order], gated=True)
    torch.testing.assert_close(out, F.silu(y[:, :inter]) * y[:, inter:], **TOL)
    with pytest.raises(RuntimeError, match="gated"):
        native.packed_linear(x, native.pack_linear(w[order]), 2 * inter, residual=torch.zeros(3, 2 * inter), gated=True)
    odd = GatedLinear(torch.randn(12, k), torch.randn(12, k))
    assert not odd.gated_kernel
    gate, up = odd.proj.weight.chunk(2)
    torch.testing.assert_close(odd(x), F.silu(F.linear(x, gate)) * F.linear(x, up), **TOL)


def test_native_norm_and_silu_mul_on_long_prefills(threads: int) -> None:
    """The one-pass norm and silu(gate) * up the long-prefill path uses, over the threads."""
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(300, 576, generator=gen)
    w = 1 + 0.1 * torch.randn(576, generator=gen)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **TOL)
    torch.testing.assert_close(native.rms_norm(x[:, ::2], w[:288], 1e-5), rms_norm(x[:, ::2], w[:288], 1e-5), **TOL)
    y = 4 * torch.randn(300, 2 * 1539, generator=gen)   # a width off the 8-float vector
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(y), F.silu(gate) * up, **TOL)
    y[0, 0], y[1, 0] = 1e4, -1e4                        # far outside the exp polynomial's range
    out = native.silu_mul(y)
    assert torch.isfinite(out).all() and out[0, 0] == y[0, 1539] * 1e4 and abs(out[1, 0]) < 1e-30


def test_packed_weight_is_huge_page_aligned_and_exact() -> None:
    w = torch.randn(40, 24)
    packed = native.pack_linear(w)
    assert packed.data_ptr() % (1 << 21) == 0 and packed.is_contiguous()
    # panel p, element (k, j) is W[16 p + j, k]; rows past N are zero
    assert torch.equal(packed[1, 5, 3], w[19, 5]) and torch.equal(packed[2, :, 8:], torch.zeros(24, 8))
    unpacked = packed.transpose(1, 2).reshape(-1, 24)[:40]
    assert torch.equal(unpacked, w)


def test_packed_kernel_rejects_bad_input() -> None:
    w = torch.randn(40, 24)
    packed = native.pack_linear(w)
    with pytest.raises(RuntimeError, match="shapes"):
        native.packed_linear(torch.randn(2, 23), packed, 40)
    with pytest.raises(RuntimeError, match="shapes"):
        native.packed_linear(torch.randn(2, 24), packed, 49)
    with pytest.raises(RuntimeError, match="fp32"):
        native.packed_linear(torch.randn(2, 24, dtype=torch.float64), packed, 40)
    with pytest.raises(RuntimeError, match="residual"):
        native.packed_linear(torch.randn(2, 24), packed, 40, None, torch.randn(3, 40))
    with pytest.raises(RuntimeError, match="bias"):
        native.packed_linear(torch.randn(2, 24), packed, 40, torch.randn(39))
    misaligned = torch.empty(packed.numel() + 1)[1:].view(packed.shape).copy_(packed)
    with pytest.raises(RuntimeError, match="aligned"):
        native.packed_linear(torch.randn(2, 24), misaligned, 40)
    with pytest.raises(RuntimeError, match="packed"):
        native.packed_linear(torch.randn(2, 24), packed.transpose(1, 2), 40)


def test_non_fp32_and_gpu_weights_keep_torch() -> None:
    assert not native.linear_supported(torch.randn(4, 4, dtype=torch.float16))
    assert not native.linear_supported(torch.randn(4))
    lin = Linear(torch.randn(8, 4, dtype=torch.float64))
    assert lin.packed is None and lin.weight_t is not None
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_native_off_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVMESH_NATIVE_KERNELS=0 (or a failed build) leaves Linear on its torch shapes."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load.cache_clear()
    try:
        w = torch.randn(48, 40)
        lin = Linear(w)
        assert lin.packed is None and lin.weight_t is not None
        x = torch.randn(5, 40)
        torch.testing.assert_close(lin(x), F.linear(x, w), **TOL)
    finally:
        native.load.cache_clear()


def test_gemm_rows() -> None:
    for m in range(2, Linear.MAX_SMALL_M + 1):
        rows = Linear.gemm_rows(m)
        assert m <= rows < m + 8
        if rows != m:
            assert rows % 8 == 0 or (m, rows) == (3, 4)
    assert [Linear.gemm_rows(m) for m in (3, 7, 9, 10, 11, 15, 16, 17, 19, 31)] == [4, 8, 9, 10, 16, 16, 16, 17, 24, 32]
