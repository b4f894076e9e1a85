"""Paged prefill / extend attention in Triton: the new tokens of every sequence of a step,
packed in one launch, attend causally to themselves and to the sequence's cached prefix
(prefix-cache hits and chunked prefill alike), reading K/V in place through the block
table. The torch twin is `reference.paged_attention`.

Sequence i has q_len = qsl[i+1] - qsl[i] new tokens and L = seq_lens[i] cached ones (the
new ones already written); new token j sits at position p = L - q_len + j and attends to
positions t <= p (and p - t < W under a sliding window W) — the reference's semantics.

Grid (B, Hq, ceil(max_q_len / BLOCK_M)): one program per sequence, query head and tile of
BLOCK_M new tokens. A program loops over tiles of BLOCK_N keys from the first position any
of its rows may see to its last row's position, with an online softmax; programs whose
tile lies past the sequence's q_len run no iteration and store nothing. Rows with q_len == 1
(the decode rows of a mixed step) take this path too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.quant import KVCache
from worker.kernels.triton_common import cache_args, dot_in_fp32, levels, load_kv_tile, next_pow2, triton_interpreted


def tile_sizes() -> tuple[int, int]:
    """(BLOCK_M new tokens per program, BLOCK_N keys per tile): 64 x 32 compiled, with 8 warps
    (for sm_90 at head_dim 128, bf16: 255 registers and no spills, where 64 x 64 spills; no
    GPU run yet), 16 x 32 in the interpreter (where padded rows cost time)."""
    return (16, 32) if triton_interpreted() else (64, 32)


@triton.jit
def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, lens_ptr, qsl_ptr, levels_ptr, scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, HEAD_BYTES: tl.constexpr, GROUP: tl.constexpr,
        DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(lens_ptr + b)
    kvh = h // G
    j = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] new-token index in the sequence
    j_mask = j < q_len
    pos = seq_len - q_len + j  # [BLOCK_M] absolute positions
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    q = tl.load(q_ptr + (q_start + j)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=j_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    first = seq_len - q_len + mt * BLOCK_M  # this tile's first position
    hi = seq_len - q_len + tl.minimum((mt + 1) * BLOCK_M, q_len)  # one past its last row's position
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
    hi = tl.where(mt * BLOCK_M < q_len, hi, lo)  # a tile past q_len: no keys
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        t_mask = t < hi
        blk = tl.load(bt_ptr + b * stride_bt + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = blk * stride_kb + (t % BLOCK_SIZE) * stride_kt + kvh * stride_kh
        k = load_kv_tile(k_ptr, row, t_mask, offs_d, d_mask, levels_ptr, QUANT, HEAD_BYTES, GROUP)
        v = load_kv_tile(v_ptr, row, t_mask, offs_d, d_mask, levels_ptr, QUANT, HEAD_BYTES, GROUP)
        if DOT_F32:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(q.dtype).to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        ok = (t[None, :] <= pos[:, None]) & t_mask[None, :] & j_mask[:, None]  # [BLOCK_M, BLOCK_N]
        if window > 0:
            ok = ok & (pos[:, None] - t[None, :] < window)
        qk = tl.where(ok, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(q.dtype).to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + j)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=j_mask[:, None] & d_mask[None, :])


def prefill(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """query [T, Hq, D] (seq i's new tokens are rows qsl[i]:qsl[i+1]) -> [T, Hq, D].

    Quantized caches are read in their stored (rotated) basis: rotate the query and the
    output around this call (`triton_attention.paged_attention` does).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    kc, vc = cache_args(k_cache), cache_args(v_cache)
    assert kc[1:] == vc[1:], "K and V caches must share quantization and layout"
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim, (query.shape, k_cache.shape)
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    query = query if query.stride(2) == 1 else query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    block_m, block_n = tile_sizes()
    grid = (num_seqs, num_q_heads, -(-max_query_len // block_m))
    _prefill_kernel[grid](
        query, kc.data, vc.data, out, block_tables, seq_lens, query_start_loc, levels(query.dtype, query.device),
        scale, sliding_window or 0, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kc.stride_block, kc.stride_token, kc.stride_head, block_tables.stride(0),
        G=num_q_heads // num_kv_heads, D=head_dim, D_PAD=next_pow2(head_dim, 16), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], QUANT=int(kc.quant), HEAD_BYTES=kc.head_bytes, GROUP=kc.group,
        DOT_F32=dot_in_fp32(query.dtype), num_warps=8)
    return out
