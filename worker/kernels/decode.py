"""Decode attention over the paged cache (one new token per sequence), and the helpers the
prefill path in `reference.py` shares with it.

A decode step gathers the blocks each sequence reads and runs one batched SDPA over them.
Padding every sequence to the longest one wastes gather bandwidth and attention work on
ragged batches (lengths 16..256 waste about half), while one SDPA per sequence pays a
per-call cost 16x. So `plan_decode` sorts the sequences by how many keys they read and
cuts them into contiguous groups that minimise `rows * keys + GROUP_COST_KEYS` per group,
once per step (the plan is memoised on the step's `AttnMetadata`); every layer reuses it.

Kernels never call `.item()` / `.tolist()`: shapes come from Python lists, tensors stay on
the device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvstore.quant import KVCache, QuantizedKV

# The cost of one more group, in (row, key) units of gather + attention work: two
# index_selects, an SDPA call, a mask and the output scatter (~50-100 us on a 2-core
# x86 CPU, where a (row, key) costs ~0.5-1 us per layer). Measured, not derived.
GROUP_COST_KEYS = 96


class DecodeGroup(NamedTuple):
    """Rows `start:stop` of the plan's sorted order, attended in one SDPA."""

    start: int
    stop: int
    seqs: torch.Tensor  # [b] int64 index in the batch of each row's sequence
    blocks: torch.Tensor  # [b * nb] int64 block ids, row-major (columns past a row's end are masked)
    num_keys: int  # S keys per row (<= nb * block_size)
    mask: torch.Tensor | None  # [b, 1, 1, S] bool (True = attend); None when every row reads all S keys
    positions: torch.Tensor | None  # [b, S] absolute position of each key; None when it is the key index


class DecodePlan(NamedTuple):
    """How to run the decode rows of one step: `seqs[j]` is the j-th row in sorted order."""

    seqs: list[int]  # index in the batch of each decode sequence, sorted by keys read
    identity: bool  # seqs == [0, 1, ..., B-1]: every sequence of the batch, in batch order
    seqs_t: torch.Tensor  # [b] int64, `seqs` on the device
    groups: list[DecodeGroup]


def plan_decode(seqs: list[int], seq_lens_list: list[int], seq_lens: torch.Tensor,
                block_tables: torch.Tensor, block_size: int, sliding_window: int | None,
                group_cost: int = GROUP_COST_KEYS) -> DecodePlan:
    """Group the decode sequences `seqs` (indices into the batch) for `decode_attention`."""
    device = block_tables.device
    window = sliding_window
    # blocks each sequence reads: [first, last]; keys read = their span (the whole prefix
    # when no window cuts it, so ragged lengths inside a block need no extra mask columns)
    first = {i: 0 if window is None else max(0, seq_lens_list[i] - window) // block_size for i in seqs}
    cut = {i: window is not None and seq_lens_list[i] > window for i in seqs}
    keys = {i: ((seq_lens_list[i] - 1) // block_size - first[i] + 1) * block_size if cut[i]
            else seq_lens_list[i] for i in seqs}
    order = sorted(seqs, key=lambda i: keys[i])
    bounds = _partition([keys[i] for i in order], group_cost)
    if len(bounds) == 2:  # one group: keep the caller's order, no permutation needed
        order = list(seqs)
    identity = order == list(range(len(seq_lens_list)))
    seqs_t = torch.tensor(order, dtype=torch.int64, device=device)
    groups = []
    for start, stop in zip(bounds, bounds[1:]):
        rows = order[start:stop]
        g_seqs = seqs_t[start:stop]
        whole = identity and (start, stop) == (0, len(order))  # the batch's own tensors serve as they are
        lens = seq_lens if whole else seq_lens.index_select(0, g_seqs)  # [b]
        tables = block_tables if whole else block_tables.index_select(0, g_seqs)  # [b, max_blocks]
        if any(cut[i] for i in rows):
            assert window is not None
            nb = max((seq_lens_list[i] - 1) // block_size - first[i] + 1 for i in rows)
            groups.append(_windowed_group(start, stop, g_seqs, lens, tables, nb, block_size, window))
            continue
        num_keys = max(seq_lens_list[i] for i in rows)
        nb = -(-num_keys // block_size)
        blocks = tables if nb == tables.shape[1] else tables[:, :nb]  # [b, nb]
        mask = None
        if any(seq_lens_list[i] != num_keys for i in rows):
            mask = (torch.arange(num_keys, device=device) < lens[:, None])[:, None, None, :]  # [b, 1, 1, S]
        groups.append(DecodeGroup(start, stop, g_seqs, blocks.reshape(-1), num_keys, mask, None))
    return DecodePlan(order, identity, seqs_t, groups)


def _windowed_group(start: int, stop: int, seqs: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
                    nb: int, block_size: int, window: int) -> DecodeGroup:
    """A group some of whose rows a sliding window cuts: each row reads the `nb` blocks from the
    one holding position L - W on, and masks what lies outside [L - W, L)."""
    device = tables.device
    first = (lens - window).clamp_(min=0) // block_size  # [b]
    cols = first[:, None] + torch.arange(nb, device=device)  # [b, nb]
    pos = (cols[:, :, None] * block_size  # [b, nb*bs] absolute position of each key
           + torch.arange(block_size, device=device)).view(stop - start, -1)
    # columns past a row's end read a valid block; masked below (their positions are >= L)
    blocks = tables.gather(1, cols.clamp_(max=tables.shape[1] - 1))  # [b, nb]
    mask = ((pos < lens[:, None]) & (pos >= lens[:, None] - window))[:, None, None, :]  # [b, 1, 1, S]
    return DecodeGroup(start, stop, seqs, blocks.reshape(-1), nb * block_size, mask, pos)


def _partition(keys: list[int], group_cost: int) -> list[int]:
    """Cut points of sorted `keys` into runs minimising sum(len(run) * max(run) + group_cost)."""
    n = len(keys)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (j - i) * keys[j - 1] + group_cost, i) for i in range(j))
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(cut[bounds[-1]])
    return bounds[::-1]


def decode_attention(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache, plan: DecodePlan,
                     scale: float, score_acc: torch.Tensor | None = None) -> torch.Tensor:
    """`query` [b, Hq, D], row j for sequence `plan.seqs[j]` -> `[b, Hq, D]` in the same order.

    With `score_acc` ([B, >= max seq_len] fp32, indexed by batch sequence) the attention is
    explicit and each key's probability, summed over query heads, is added at its position.
    """
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_store, v_store = storage(k_cache), storage(v_cache)
    width = k_store.shape[3]  # head_dim, or slot bytes when quantized
    outs = []
    for g in plan.groups:
        b = g.stop - g.start
        k = k_store.index_select(0, g.blocks).view(b, -1, num_kv_heads, width)  # [b, nb*bs, Hkv, D]
        v = v_store.index_select(0, g.blocks).view(b, -1, num_kv_heads, width)
        if g.num_keys < k.shape[1]:
            k, v = k[:, :g.num_keys], v[:, :g.num_keys]
        k, v = load(k, k_cache, query.dtype).transpose(1, 2), load(v, v_cache, query.dtype).transpose(1, 2)
        # fold the query heads of one kv head into the query-length dim: GQA without repeating K/V
        q = query[g.start:g.stop].view(b, num_kv_heads, group, head_dim)  # [b, Hkv, G, D]
        if score_acc is None:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale))
            continue
        out, probs = explicit_attention(q, k, v, g.mask, scale)
        weights = probs.sum(dim=(1, 2))  # [b, S]
        if g.positions is None:
            score_acc[:, :g.num_keys].index_add_(0, g.seqs, weights)
        else:  # masked keys add 0 wherever they land
            rows = g.seqs[:, None].expand(-1, g.num_keys)
            score_acc.index_put_((rows, g.positions.clamp(max=score_acc.shape[1] - 1)), weights, accumulate=True)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [b, Hkv, G, D]
    return out.reshape(num_rows, num_q_heads, head_dim)


def storage(cache: KVCache) -> torch.Tensor:
    """The tensor a kernel index_selects blocks from: the cache itself, or its slot bytes."""
    return cache.slots if isinstance(cache, QuantizedKV) else cache


def load(gathered: torch.Tensor, cache: KVCache, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from `storage(cache)` as values in `dtype`; quantized ones are dequantized
    in the codec's rotated basis (`paged_attention` rotates the query and output to match)."""
    if isinstance(cache, QuantizedKV):
        return cache.codec.dequantize(gathered, dtype, rotated=True)
    return gathered if gathered.dtype == dtype else gathered.to(dtype)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale, masked) v and those probabilities, in fp32: the path that collects
    scores, so the weights it reports are exactly the ones the output used.

    q [..., M, D], k and v [..., S, D], mask (True = attend) broadcastable to [..., M, S].
    """
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [..., M, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [..., M, S]
    return (probs @ v.float()).to(q.dtype), probs
