"""Paged attention in plain torch: the CPU kernels and the oracle for every GPU twin.

One exception on CPU: fp32 queries over fp32 caches, when no scores are collected, go to the
native kernel in `worker.kernels.native`, which reads the cache in place: decode rows, and
prefill tokens as decode rows of their own (`AttnMetadata.token_rows`), so that a token's
attention is the same bits however its prompt is cut into steps; the torch paths here stay its
oracle and its fallback (tests run both).

Cache layout (see `kvstore.tensors`): `k_cache`, `v_cache` are `[num_blocks, block_size,
num_kv_heads, head_dim]`; token slot `slot = block_id * block_size + offset`.

Semantics of `paged_attention`: sequence i has `q_len` new tokens and `L = seq_lens[i]`
cached tokens (the new ones already written by `write_kv`). New token j sits at absolute
position `p = L - q_len + j` and attends to every cached position `t <= p`, and with a
sliding window `W` only to those with `p - t < W` (HF Mistral semantics). Query head h
reads kv head `h // (Hq // Hkv)` (MHA, GQA and MQA alike).

A quantized cache (`kvstore.quant.QuantizedKV`: slot bytes plus a codec) goes where a
tensor cache goes: `write_kv` quantizes the new rows into their slots, and attention gathers
the slots of only the blocks it reads and dequantizes those to the query dtype before SDPA
(never the whole cache). Plain tensor caches take exactly the path they took before.

Kernels gather whole blocks and mask the slots they must not read, so those slots may hold
any FINITE value (a NaN there would still reach the output through `0 * NaN`); the pool in
`kvstore.tensors` is zero-filled for that reason.

The kernels take Python lists from `AttnMetadata` for every shape decision, so they never
call `.item()` / `.tolist()` (no host sync on a GPU, no per-token Python).

Score collection (H2O eviction): when `AttnMetadata.score_acc` is set, every call adds the
softmax weight each cached key received, summed over query heads and the sequence's new
tokens (new token j of q weighted `score_decay ** (q - 1 - j)`, so a chunk counts as if its
queries had come one per step); those calls compute attention explicitly (fp32 softmax) so
the weights reported are the ones the output used. When it is None the kernels do no extra
work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvstore.quant import KVCache, QuantizedKV
from worker.kernels import native
from worker.kernels.decode import DecodePlan, decode_attention, explicit_attention, load, plan_decode, storage


class DecodeRows(NamedTuple):
    rows: torch.Tensor  # [b] int64 query row (token index) of each row
    block_tables: torch.Tensor  # [b, max_blocks] their block table rows
    seq_lens: torch.Tensor  # [b]


@dataclass(frozen=True, slots=True, eq=False)
class AttnMetadata:
    """Where this step's tokens go in the paged cache and what each one may attend to.

    Build it once per step with `AttnMetadata.build`; every layer reuses it (and the decode
    plan the first layer memoises on it, see `decode_plan`).
    """

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int64; seq i's new tokens are rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [B] int64 tokens in the cache for seq i AFTER this step's write
    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # [B, max_seq_len] fp32 or None. When set, every `paged_attention` call ADDS to
    # score_acc[i, t] the softmax weight cached position t of seq i received, summed over query
    # heads and seq i's new tokens (for H2O eviction); the tensor is mutated in place.
    score_acc: torch.Tensor | None = None
    # weight of new token j of q in score_acc: score_decay ** (q - 1 - j) (1.0: a plain sum)
    score_decay: float = 1.0
    _plans: dict[tuple[int, int | None], DecodePlan] = field(default_factory=dict, init=False, repr=False)
    # token_rows() memo
    _rows: dict[str, DecodeRows] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.query_lens_list) != len(self.seq_lens_list):
            raise ValueError(f"query_lens_list has {len(self.query_lens_list)} entries, "
                             f"seq_lens_list {len(self.seq_lens_list)}")
        acc = self.score_acc
        if acc is not None and (tuple(acc.shape) != (self.num_seqs, self.max_seq_len) or acc.dtype != torch.float32):
            raise ValueError(f"score_acc is {acc.dtype} {tuple(acc.shape)}; need float32 "
                             f"{(self.num_seqs, self.max_seq_len)} (num_seqs, max_seq_len)")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @property
    def is_decode(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return all(q == 1 for q in self.query_lens_list)

    def decode_plan(self, block_size: int, sliding_window: int | None) -> DecodePlan:
        """How the q_len == 1 sequences of this step run (see `worker.kernels.decode`).

        Memoised: built by the first layer's call, reused by every other layer (the one
        mutation a query makes here, invisible to callers).
        """
        key = (block_size, sliding_window)
        plan = self._plans.get(key)
        if plan is None:
            seqs = [i for i, q in enumerate(self.query_lens_list) if q == 1]
            plan = plan_decode(seqs, self.seq_lens_list, self.seq_lens, self.block_tables, block_size,
                               sliding_window)
            self._plans[key] = plan
        return plan

    def token_rows(self) -> DecodeRows:
        """Every new token as a decode row of its own: its sequence's block table and, as its
        length, its position + 1 (what it may attend to). The native kernel runs a prefill this
        way, so that each token's attention is the arithmetic of a decode step (memoised)."""
        rows = self._rows.get("tokens")
        if rows is None:
            dev = self.seq_lens.device
            q_lens = torch.tensor(self.query_lens_list, dtype=torch.int64, device=dev)  # [B]
            seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=dev), q_lens)  # [T]
            tokens = torch.arange(self.num_tokens, dtype=torch.int64, device=dev)
            lens = tokens - self.query_start_loc[seq_of_token] + (self.seq_lens - q_lens)[seq_of_token] + 1
            rows = DecodeRows(tokens, self.block_tables.index_select(0, seq_of_token), lens)
            self._rows["tokens"] = rows
        return rows

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: str | torch.device = "cpu",
              collect_scores: bool = False, score_decay: float = 1.0) -> AttnMetadata:
        """Metadata for one step; new tokens of seq i sit at positions `seq_len - q_len .. seq_len - 1`.

        `block_tables[i]` must cover those positions (`ceil(seq_len / block_size)` ids at least).
        `collect_scores` allocates a zero `score_acc` [B, max(seq_lens)] fp32 on `device`: after a
        forward pass it holds the attention each cached token received, summed over layers too
        (queries weighted by `score_decay`, see the field).
        """
        num_seqs = len(query_lens)
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(f"query_lens, seq_lens, block_tables have {num_seqs}, {len(seq_lens)}, "
                             f"{len(block_tables)} entries; they must match")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        for i, (q, n, row) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if not 1 <= q <= n:
                raise ValueError(f"seq {i}: query_len={q}, seq_len={n}; need 1 <= query_len <= seq_len")
            if len(row) * block_size < n:
                raise ValueError(f"seq {i}: {len(row)} blocks of {block_size} cannot hold seq_len={n}")
        max_blocks = max((len(row) for row in block_tables), default=0) or 1
        bt = torch.tensor([list(row) + [0] * (max_blocks - len(row)) for row in block_tables],  # [B, max_blocks]
                          dtype=torch.int64).view(num_seqs, max_blocks)
        qsl = torch.tensor(_cumsum([0] + list(query_lens)), dtype=torch.int64)  # [B+1]
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)  # [B]
        if all(q == 1 for q in query_lens):  # decode: one token per sequence, plain Python is cheaper
            slots = torch.tensor([row[(n - 1) // block_size] * block_size + (n - 1) % block_size
                                  for n, row in zip(seq_lens, block_tables)], dtype=torch.int64)  # [B]
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.int64)  # [B]
            seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [T]
            positions = (torch.arange(sum(query_lens)) - qsl[seq_of_token]  # [T] absolute positions
                         + (s_lens - q_lens)[seq_of_token])
            block_ids = bt[seq_of_token, positions // block_size]  # [T]
            slots = block_ids * block_size + positions % block_size  # [T]
        dev = torch.device(device)
        acc = (torch.zeros(num_seqs, max(seq_lens, default=0), dtype=torch.float32, device=dev)  # [B, S]
               if collect_scores else None)
        return cls(slot_mapping=slots.to(dev), query_start_loc=qsl.to(dev), seq_lens=s_lens.to(dev),
                   block_tables=bt.to(dev), query_lens_list=list(query_lens),
                   seq_lens_list=list(seq_lens), score_acc=acc, score_decay=score_decay)


def query_weights(q_len: int, decay: float, device: str | torch.device = "cpu") -> torch.Tensor:
    """[q_len] fp32: `decay ** (q_len - 1 - j)`, the weight of new token j's query in score
    collection (the last query weighs 1, each earlier one `decay` less per step)."""
    age = torch.arange(q_len - 1, -1, -1, device=device, dtype=torch.float32)
    return torch.full_like(age, decay).pow_(age)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V rows `[T, Hkv, D]` at their slots (in place; quantized if the cache is)."""
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    if isinstance(k_cache, QuantizedKV):
        assert isinstance(v_cache, QuantizedKV) and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
        assert key.shape[1:] == k_cache.shape[2:], (key.shape, k_cache.shape)
        assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
        num_kv_heads, slot_bytes = k_cache.slots.shape[2], k_cache.slots.shape[3]
        k_cache.slots.view(-1, num_kv_heads, slot_bytes).index_copy_(  # [N*bs, Hkv, slot_bytes]
            0, slot_mapping, k_cache.codec.quantize(key))
        v_cache.slots.view(-1, num_kv_heads, slot_bytes).index_copy_(
            0, slot_mapping, v_cache.codec.quantize(value))
        return
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert key.shape[1:] == k_cache.shape[2:], (key.shape, k_cache.shape)
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [N*bs, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)  # [N*bs, Hkv, D]
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(k_cache: KVCache, v_cache: KVCache, block_table_row: torch.Tensor | list[int],
              seq_len: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` cached tokens of one sequence, densely: `(k, v)` each `[L, Hkv, D]`.

    A plain cache keeps its dtype unless `dtype` is given; a quantized one is dequantized to
    `dtype` (fp32 when None).
    """
    assert len(k_cache.shape) == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    k_store, v_store = storage(k_cache), storage(v_cache)
    block_size, num_kv_heads, width = k_store.shape[1:]
    num_blocks = -(-seq_len // block_size)
    row = torch.as_tensor(block_table_row, dtype=torch.int64, device=k_store.device)[:num_blocks]
    assert row.numel() == num_blocks, f"block table has {row.numel()} ids; {num_blocks} needed"
    k = k_store.index_select(0, row).view(-1, num_kv_heads, width)[:seq_len]  # [L, Hkv, D | slot_bytes]
    v = v_store.index_select(0, row).view(-1, num_kv_heads, width)[:seq_len]
    if isinstance(k_cache, QuantizedKV):
        assert isinstance(v_cache, QuantizedKV)
        dtype = dtype or torch.float32
        return k_cache.codec.dequantize(k, dtype), v_cache.codec.dequantize(v, dtype)  # [L, Hkv, D]
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


def paged_attention(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                    meta: AttnMetadata, scale: float, sliding_window: int | None = None,
                    allow_native: bool = True) -> torch.Tensor:
    """Attention of this step's queries over the paged cache: `[T, Hq, D] -> [T, Hq, D]`.

    Decode sequences (q_len == 1) run as a few batched SDPAs, grouped by length
    (`worker.kernels.decode`); each prefill sequence (q_len > 1)
    runs its own SDPA with a causal-with-offset mask. Caches in another dtype than `query`
    are upcast after the gather; quantized caches are dequantized to `query.dtype` there.
    With `meta.score_acc` set, also adds each key's attention weight into it (in place).
    `allow_native=False` keeps fp32 decode rows off the native kernel (the `torch` backend).
    """
    assert query.dim() == 3 and len(k_cache.shape) == 4 and k_cache.shape == v_cache.shape
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert num_tokens == meta.num_tokens, (num_tokens, meta.query_lens_list)
    assert sliding_window is None or sliding_window > 0, sliding_window
    if isinstance(k_cache, QuantizedKV):
        assert isinstance(v_cache, QuantizedKV) and v_cache.codec == k_cache.codec
        rot = k_cache.codec.rotation(query.device, torch.float32)  # [D, D] symmetric, R @ R = I
        if rot is not None:
            # the cache holds K R and V R: softmax((q R)(K R)ᵀ) (V R) R = softmax(q Kᵀ) V;
            # rotated in fp32 (1/sqrt(D) is not exact in half precision for every D)
            q = (query.float() @ rot).to(query.dtype)
            out = _attention(q, k_cache, v_cache, meta, scale, sliding_window, allow_native)
            return (out.float() @ rot).to(query.dtype)
    return _attention(query, k_cache, v_cache, meta, scale, sliding_window, allow_native)


def _attention(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
               meta: AttnMetadata, scale: float, sliding_window: int | None, allow_native: bool) -> torch.Tensor:
    acc = meta.score_acc
    # fp32 rows on CPU read the cache in place (worker.kernels.native) unless scores are collected
    in_place = allow_native and acc is None and native.decode_supported(query, k_cache, v_cache)
    if in_place:
        # every row, prefill tokens included, by the decode kernel's arithmetic: a token's
        # attention (each key's dot, the softmax's sum, the V pass, all in key order) is then the
        # same bits whichever way its prompt is computed: whole, in chunks, a token a step, beside
        # other sequences (SDPA's blocking depends on the query and key counts)
        each = meta if meta.is_decode else meta.token_rows()
        return native.paged_decode(query, k_cache, v_cache, each.block_tables, each.seq_lens, scale,  # type: ignore[arg-type]
                                   sliding_window)
    plan = meta.decode_plan(k_cache.shape[1], sliding_window)
    if plan.identity and len(plan.seqs) == meta.num_tokens:  # pure decode, order kept
        return decode_attention(query, k_cache, v_cache, plan, scale, acc)
    out = torch.empty_like(query)  # [T, Hq, D]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len > 1:
            out[start:start + q_len] = _prefill_one(
                query[start:start + q_len], k_cache, v_cache, meta.block_tables[i], seq_len,
                scale, sliding_window, None if acc is None else acc[i], meta.score_decay)
        start += q_len
    if plan.seqs:
        # the query row of each decode sequence, in the plan's order
        rows = plan.seqs_t if meta.is_decode else meta.query_start_loc.index_select(0, plan.seqs_t)
        res = decode_attention(query.index_select(0, rows), k_cache, v_cache, plan, scale, acc)  # [b, Hq, D]
        out.index_copy_(0, rows, res)
    return out


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _prefill_one(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
                 block_table_row: torch.Tensor, seq_len: int, scale: float,
                 sliding_window: int | None, score_row: torch.Tensor | None = None,
                 score_decay: float = 1.0) -> torch.Tensor:
    """One sequence's q_len new tokens over its first `seq_len` cached tokens: `[q, Hq, D]`.

    With `score_row` ([>= seq_len] fp32) the attention is explicit and each key's probability,
    summed over query heads and over new tokens (token j weighted `score_decay ** (q - 1 - j)`),
    is added at its position.
    """
    q_len, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_pos = seq_len - q_len  # absolute position of the first new token
    start = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    first_block = start // block_size
    num_blocks = -(-seq_len // block_size) - first_block
    blocks = block_table_row[first_block:first_block + num_blocks]  # [nb]
    offset = start - first_block * block_size
    k_store, v_store = storage(k_cache), storage(v_cache)
    width = k_store.shape[3]  # head_dim, or slot bytes when quantized
    k = k_store.index_select(0, blocks).view(-1, num_kv_heads, width)[offset:offset + seq_len - start]
    v = v_store.index_select(0, blocks).view(-1, num_kv_heads, width)[offset:offset + seq_len - start]
    k, v = load(k, k_cache, query.dtype), load(v, v_cache, query.dtype)  # [S, Hkv, D]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, S, D]
    q = query.transpose(0, 1)[None]  # [1, Hq, q, D]
    if q_len == seq_len and score_row is None and (sliding_window is None or seq_len <= sliding_window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,  # a fresh prompt
                                             enable_gqa=num_q_heads != num_kv_heads)
        return out[0].transpose(0, 1)  # [q, Hq, D]
    p = torch.arange(first_pos, seq_len, device=query.device)[:, None]  # [q, 1]
    t = torch.arange(start, seq_len, device=query.device)[None, :]  # [1, S]
    mask = t <= p  # [q, S]
    if sliding_window is not None:
        mask &= (p - t) < sliding_window
    if score_row is not None:
        qg = q[0].view(num_kv_heads, num_q_heads // num_kv_heads, q_len, head_dim)  # [Hkv, G, q, D]
        out, probs = explicit_attention(qg, k[0][:, None], v[0][:, None], mask, scale)  # [Hkv, G, q, D|S]
        weight = query_weights(q_len, score_decay, query.device)  # [q]
        score_row[start:seq_len] += weight @ probs.sum(dim=(0, 1))  # [S]
        return out.reshape(num_q_heads, q_len, head_dim).transpose(0, 1)  # [q, Hq, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=num_q_heads != num_kv_heads)
    return out[0].transpose(0, 1)  # [q, Hq, D]
