"""The model's linear layers over weights in their own format (worker/model/weights.py): `Linear`
(one matrix, with the native packed kernels' fused norm / residual epilogues), `GatedLinear` (the
MLP's gate and up projections in one matrix, SiLU-gated), `rms_norm` (HF's arithmetic) and
`pack_huge` (panels in huge pages). Used by `worker.model.llama`'s layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.kernels import native
from worker.model.weights import (
    BLOCK,
    PANEL,
    Bf16Weight,
    PackedWeight,
    QuantRows,
    Weight,
    WeightFormat,
    cat_rows,
    dense,
    format_of,
    pack,
    take_rows,
    weight_shape,
)


def pack_huge(w: Weight, fmt: WeightFormat) -> PackedWeight:
    """`pack` into huge-page memory (the kernel streams it every step)."""
    n, k = weight_shape(w)
    return pack(w, fmt, native.empty_huge_bytes(-(-n // PANEL) * (k // BLOCK) * fmt.record_bytes))


class Linear:
    """y = x Wᵀ + b, with the kernel that is fastest on CPU for the number of rows.

    fp32 on CPU with the native kernels built: up to MAX_PACKED_M rows (decode) run
    `native.packed_linear` over a copy of W packed once here, which streams the weights near the
    machine's read bandwidth and reads them once for all rows (see csrc/linear.cpp); more rows
    (prefill) run F.linear, the GEMM library at its matmul peak, with the residual add inside
    the GEMM (addmm) and the input norm in one native pass. Without the native kernels
    (`KVMESH_NATIVE_KERNELS=0`, no compiler, no AVX2) the torch shapes measured on a 2-core
    x86 CPU: one row against a contiguous Wᵀ [in, out] (~35% faster than F.linear), 2..32 rows
    as W · xᵀ (20-60% faster), wider batches F.linear. On GPU it is always F.linear and no
    copy of W is kept.
    """

    MAX_SMALL_M = 32
    MAX_PACKED_M = 32

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None,
                 packed_rows: torch.Tensor | None = None, matmul: bool = True) -> None:
        """`weight`: a dense tensor, or quantized / bf16-stored rows (worker.model.weights), which
        on a CPU with the kernel are packed in their own format and run by `native.qlinear` for
        every row count (no fp32 copy is kept), else dequantized here. `packed_rows`: the order of
        W's rows in the packed copy (GatedLinear's interleaving; then only the caller that knows
        the order runs the packed kernel). `matmul=False`: only `rows` is used (an untied
        embedding): a dense weight gets no packed copy."""
        self.qweight: PackedWeight | None = None
        if isinstance(weight, (QuantRows, Bf16Weight)):
            fmt = format_of(weight)
            if native.qlinear_isa() and weight_shape(weight)[1] % BLOCK == 0:
                rows = weight if packed_rows is None else take_rows(weight, packed_rows)
                self.qweight = pack_huge(rows, fmt)
                weight = torch.empty(0, weight_shape(weight)[1])
            else:
                weight = dense(weight)
        self.weight = weight.contiguous()                         # [out, in] ([0, in]: packed in its format)
        self.bias = bias
        self.out_features = self.qweight.n if self.qweight is not None else weight.shape[0]
        self.cpu = weight.device.type == "cpu"
        supported = matmul and self.qweight is None and native.linear_supported(self.weight) \
            and (bias is None or bias.dtype == torch.float32)
        self.packed = native.pack_linear(self.weight if packed_rows is None else self.weight[packed_rows]) \
            if supported else None                                # [ceil(out / 16), in, 16]
        self.packed_in_order = (self.packed is not None or self.qweight is not None) and packed_rows is None
        self.weight_t = self.weight.t().contiguous() if matmul and self.cpu and self.packed is None \
            and self.qweight is None else None                    # [in, out]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, in] (the embedding lookup), dequantized when W is packed in its own format."""
        if self.qweight is not None:
            return native.qrows(self.qweight.data, self.qweight.fmt.kernel_code, self.qweight.n, ids)
        return F.embedding(ids, self.weight)

    def _q(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 1e-6, gated: bool = False) -> torch.Tensor:
        q = self.qweight
        assert q is not None
        return native.qlinear(x, q.data, q.fmt.kernel_code, q.n, self.bias, residual, norm_weight, eps, gated)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.qweight is not None and self.packed_in_order:
            return self._q(x)
        if self.packed is not None and self.packed_in_order and m <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias)
        if self.weight_t is None or m > self.MAX_SMALL_M:
            return F.linear(x, self.weight, self.bias)
        if m == 1:
            y = x @ self.weight_t                                 # [1, out]
        else:
            y = self._w_xt(x).t().contiguous()                    # [M, out]
        return y + self.bias if self.bias is not None else y

    @staticmethod
    def gemm_rows(m: int) -> int:
        """How many rows the W · xᵀ GEMM runs for m rows (2..MAX_SMALL_M) on the torch path.

        The GEMM's time is not monotone in its row count. Measured over SmolLM2's 121 decode
        GEMMs (same CPU): 15 rows take ~1.8x as long as 16, 23 ~1.6x as long as 24, 12 ~1.1x;
        counts of 8k, 8k + 1 and 8k + 2 rows run about as fast as their neighbours below. So
        other counts from 7 up round up to a multiple of 8 (zero rows, sliced off), and 3 -> 4.
        """
        if m <= 6:
            return 4 if m == 3 else m
        return m if m % 8 <= 2 else -(-m // 8) * 8

    def _w_xt(self, x: torch.Tensor) -> torch.Tensor:
        """W · xᵀ [out, M], run on `gemm_rows(M)` rows (zero rows appended, then sliced off)."""
        m = x.shape[0]
        rows = self.gemm_rows(m)
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        y = torch.mm(self.weight, x.t())                          # [out, rows]
        return y if rows == m else y[:, :m]

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)); the packed kernel normalises x itself (one call
        instead of the norm's ops: at batch 1 each op costs as much as a small GEMV)."""
        if self.qweight is not None and self.packed_in_order:
            return self._q(x, norm_weight=norm_weight, eps=eps)
        if self.packed is not None and self.packed_in_order and x.shape[0] <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias, norm_weight=norm_weight, eps=eps)
        if self.packed is not None:  # a long prefill: the norm in one native pass, then the GEMM
            return self(native.rms_norm(x, norm_weight, eps))
        return self(rms_norm(x, norm_weight, eps))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + (x Wᵀ + b); the packed kernel adds in its epilogue, and on the W · xᵀ path
        the add reads the transposed product directly instead of copying it back first."""
        m = x.shape[0]
        if self.qweight is not None and self.packed_in_order:
            return self._q(x, residual)
        if self.packed is not None and self.packed_in_order and m <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias, residual)
        if self.packed is not None and self.bias is None:  # a long prefill: the add inside the GEMM
            return torch.addmm(residual, x, self.weight.t())
        if self.weight_t is None or not 1 < m <= self.MAX_SMALL_M:
            return residual + self(x)
        y = self._w_xt(x)                                         # [out, M]
        if self.bias is not None:
            y = y + self.bias[:, None]
        return residual + y.t()                                   # [M, out], contiguous like residual


class GatedLinear:
    """silu(x W_gateᵀ) * (x W_upᵀ), [M, I]: the MLP's gate and up projections as one weight.

    For the packed kernel the rows are packed interleaved, 8 gate rows then the 8 up rows of the
    same channels, so each 16-row panel yields 8 finished outputs and the kernel applies
    silu(gate) * up in its epilogue; otherwise one GEMM over [gate; up], then chunk, silu, mul.
    """

    GROUP = 8

    def __init__(self, gate: Weight, up: Weight) -> None:
        assert weight_shape(gate) == weight_shape(up), (weight_shape(gate), weight_shape(up))
        i = weight_shape(gate)[0]
        # packed rows g0..g7, u0..u7, g8..g15, u8..u15, ...: [2, I / 8, 8] -> [I / 8, 2, 8]
        order = torch.arange(2 * i).view(2, i // self.GROUP, self.GROUP).transpose(0, 1).flatten() \
            if i % self.GROUP == 0 else None
        self.proj = Linear(cat_rows([gate, up]), packed_rows=order)   # [2 I, in]
        self.packed = self.proj.packed if order is not None else None   # interleaved rows
        self.qgated = self.proj.qweight is not None and order is not None
        self.gated_kernel = self.packed is not None or self.qgated

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.qgated:
            return self.proj._q(x, gated=True)
        if self.packed is not None and x.shape[0] <= Linear.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.proj.out_features, gated=True)
        if self.proj.packed is not None:  # a long prefill: silu(gate) * up in one native pass
            return native.silu_mul(self.proj(x))
        gate, up = self.proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)), in one kernel call on the packed path."""
        if self.qgated:
            return self.proj._q(x, norm_weight=norm_weight, eps=eps, gated=True)
        if self.packed is not None and x.shape[0] <= Linear.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.proj.out_features, norm_weight=norm_weight,
                                        eps=eps, gated=True)
        if self.proj.packed is not None:
            return self(native.rms_norm(x, norm_weight, eps))
        return self(rms_norm(x, norm_weight, eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as HF's LlamaRMSNorm (variance in fp32, then cast back) so outputs match.
    dtype = x.dtype
    if dtype == torch.float32:
        if x.shape[0] <= Linear.MAX_SMALL_M:  # one op, bit-identical in fp32; slower on long prefills
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
