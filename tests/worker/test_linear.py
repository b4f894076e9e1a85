"""worker.model.Linear: every row count's GEMM shape (row vector, padded W · xᵀ, F.linear)
gives F.linear's result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model import Linear


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    lin = Linear(w, b)
    for m in range(1, Linear.MAX_SMALL_M + 9):
        x = torch.randn(m, 40, generator=gen)
        residual = torch.randn(m, 48, generator=gen)
        expected = F.linear(x, w, b)
        out = lin(x)
        assert out.shape == (m, 48) and out.is_contiguous()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin.add_to(residual, x), residual + expected, atol=1e-5, rtol=1e-5)
        # a strided input (a column slice) takes the same paths
        wide = torch.randn(m, 80, generator=gen)
        torch.testing.assert_close(lin(wide[:, ::2]), F.linear(wide[:, ::2], w, b), atol=1e-5, rtol=1e-5)


def test_gemm_rows() -> None:
    for m in range(2, Linear.MAX_SMALL_M + 1):
        rows = Linear.gemm_rows(m)
        assert m <= rows < m + 8
        if rows != m:
            assert rows % 8 == 0 or (m, rows) == (3, 4)
    assert [Linear.gemm_rows(m) for m in (3, 7, 9, 10, 11, 15, 16, 17, 19, 31)] == [4, 8, 9, 10, 16, 16, 16, 17, 24, 32]
