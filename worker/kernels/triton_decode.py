"""Paged decode attention in Triton (flash-decoding): one query token per sequence, K/V read
in place through the block table; the torch twin is `reference.paged_attention` on a step
whose sequences all have q_len == 1.

Two launches:
1. `_decode_split_kernel`, grid (B, Hkv, num_splits): one program takes ALL query heads of
   one kv head (GQA / MQA read each K/V byte once; the G heads are padded to 16 rows for
   `tl.dot`) over one split of the sequence's keys — `split_tokens` consecutive positions
   of `[start, L)`, where `start = max(0, L - W)` under a sliding window W. It keeps an
   online softmax over tiles of BLOCK_N keys and writes its partial output (normalised)
   and its log-sum-exp.
2. `_decode_reduce_kernel`, grid (B, Hq): combines the splits by their log-sum-exp.
Splitting the keys lets batch 1 with a long context fill the GPU; `plan_splits` picks
the split so that B * Hkv * num_splits programs cover the GPU a couple of times. Programs
whose split lies past a sequence's end write an empty partial (lse = -inf).

Every shape decision comes from Python ints (`max_len` from `AttnMetadata.seq_lens_list`,
or fixed by the caller): no `.item()`, so a captured CUDA graph replays it with new
lengths as long as `num_splits * split_tokens` still covers them.

H2O (`score_acc`): with `logits` given, the split kernel also stores every scaled q·k
(fp32, -inf outside the window) at [b, h, position]; the wrapper turns them into the
probabilities the output used with the reduced log-sum-exp and adds their sum over heads.

Quantized caches are dequantized in registers (`triton_common.load_kv_tile`); fp8 / int4
are attended in the rotated basis, the query and output rotated in torch like the reference.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvstore.quant import KVCache
from worker.kernels.triton_common import Quant, cache_args, dot_in_fp32, levels, load_kv_tile, next_pow2

TARGET_PROGRAMS = 512  # ~4 programs per SM of an H100/H200 (132 SMs)
# Keys per tile. Compiled for sm_90 (Triton 3.7.1, ptxas -v; no GPU run yet): at head_dim 128
# in bf16, 32 keys with 4 warps use 232 registers and no spills and pipeline 13 KiB of K/V
# through shared memory; 64 keys spill with 4 warps and need 8 (one CTA per SM). Quantized
# caches take 8 warps (4 spill: int4's dequantization holds more per element).
BLOCK_N = 32


class Splits(NamedTuple):
    split_tokens: int  # keys per split (a multiple of BLOCK_N)
    num_splits: int


def plan_splits(batch: int, num_kv_heads: int, max_keys: int, target_programs: int = TARGET_PROGRAMS,
                tile: int = BLOCK_N) -> Splits:
    """How to cut up to `max_keys` keys per sequence so B * Hkv * splits ~ `target_programs`
    (never fewer than one tile of `tile` keys per split)."""
    assert batch > 0 and num_kv_heads > 0 and max_keys > 0, (batch, num_kv_heads, max_keys)
    want = max(1, -(-target_programs // (batch * num_kv_heads)))
    tiles = -(-max_keys // tile)
    per_split = -(-tiles // min(want, tiles))
    split_tokens = per_split * tile
    return Splits(split_tokens, -(-max_keys // split_tokens))


@triton.jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, levels_ptr, part_out_ptr, part_lse_ptr, logits_ptr,
        scale, window, split_tokens, num_splits, logits_len,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, HEAD_BYTES: tl.constexpr,
        GROUP: tl.constexpr, STORE_LOGITS: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    lo = start + s * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute positions
        t_mask = t < hi
        blk = tl.load(bt_ptr + b * stride_bt + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = blk * stride_kb + (t % BLOCK_SIZE) * stride_kt + kvh * stride_kh  # [BLOCK_N]
        k = load_kv_tile(k_ptr, row, t_mask, offs_d, d_mask, levels_ptr, QUANT, HEAD_BYTES, GROUP)
        v = load_kv_tile(v_ptr, row, t_mask, offs_d, d_mask, levels_ptr, QUANT, HEAD_BYTES, GROUP)
        if DOT_F32:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(q.dtype).to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)))
        qk = tl.where(t_mask[None, :], qk * scale, float("-inf"))  # [G_PAD, BLOCK_N]
        if STORE_LOGITS:
            tl.store(logits_ptr + (b * tl.num_programs(1) * G + heads[:, None]) * logits_len
                     + t[None, :], qk, mask=g_mask[:, None] & t_mask[None, :])
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(q.dtype).to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0  # a split past this sequence's end (or a padded head row)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = (b * tl.num_programs(1) * G + heads) * num_splits + s  # [G_PAD] partial row of (b, head, s)
    tl.store(part_out_ptr + base[:, None] * D_PAD + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(part_lse_ptr + base, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits, stride_ob, stride_oh,
                          D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))  # [S_PAD]
    m = tl.max(lse, axis=0)  # finite: split 0 always holds key L - 1
    w = tl.exp(lse - m)
    total = tl.sum(w, axis=0)
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * D_PAD + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)  # [S_PAD, D_PAD]
    out = tl.sum(parts * (w / total)[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)
    tl.store(lse_ptr + row, m + tl.log(total))


def decode(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, sliding_window: int | None, splits: Splits,
           logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, Hq, D] (row b: one token of block table row b, over its first `seq_lens[b]`
    cached tokens, the last `sliding_window` of them) -> (out [B, Hq, D], lse [B, Hq] fp32).

    `splits` must cover every sequence's keys: `num_splits * split_tokens >= min(L, W)`.
    Quantized caches are read in their stored (rotated) basis: rotate the query and the
    output around this call (`paged_attention` in `triton_attention` does). With `logits`
    ([B, Hq, >= max L] fp32, filled with -inf) each attended key's scaled score is stored.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    kc, vc = cache_args(k_cache), cache_args(v_cache)
    assert kc[1:] == vc[1:], "K and V caches must share quantization and layout"
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads and k_cache.shape[3] == head_dim, (query.shape, k_cache.shape)
    assert block_tables.shape[0] == num_seqs and seq_lens.shape == (num_seqs,), (block_tables.shape, seq_lens.shape)
    assert splits.split_tokens % BLOCK_N == 0, splits
    query = query if query.stride(2) == 1 else query.contiguous()
    d_pad = next_pow2(head_dim, 16)
    part_out = torch.empty(num_seqs, num_q_heads, splits.num_splits, d_pad, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_seqs, num_q_heads, splits.num_splits, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query)
    lse = torch.empty(num_seqs, num_q_heads, dtype=torch.float32, device=query.device)
    if logits is not None:
        assert logits.shape[:2] == (num_seqs, num_q_heads) and logits.is_contiguous(), logits.shape
    _decode_split_kernel[(num_seqs, num_kv_heads, splits.num_splits)](
        query, kc.data, vc.data, block_tables, seq_lens, levels(query.dtype, query.device), part_out, part_lse,
        part_lse if logits is None else logits,
        scale, sliding_window or 0, splits.split_tokens, splits.num_splits, 0 if logits is None else logits.shape[2],
        query.stride(0), query.stride(1), kc.stride_block, kc.stride_token, kc.stride_head, block_tables.stride(0),
        G=group, G_PAD=next_pow2(group, 16), D=head_dim, D_PAD=d_pad, BLOCK_N=BLOCK_N, BLOCK_SIZE=k_cache.shape[1],
        QUANT=int(kc.quant), HEAD_BYTES=kc.head_bytes, GROUP=kc.group, STORE_LOGITS=logits is not None,
        DOT_F32=dot_in_fp32(query.dtype), num_warps=4 if kc.quant is Quant.NONE else 8)
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out, lse, splits.num_splits, out.stride(0), out.stride(1),
        D=head_dim, D_PAD=d_pad, S_PAD=next_pow2(splits.num_splits, 2))
    return out, lse
