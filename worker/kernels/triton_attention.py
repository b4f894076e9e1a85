"""The Triton attention backend: `write_kv` and `paged_attention` with the reference's
signatures (`worker.kernels.reference`, the oracle they are tested against).

- a step whose sequences all bring one token runs the split-K decode kernel
  (`triton_decode`); any other step runs the varlen prefill kernel over every sequence
  (`triton_prefill`; its q_len == 1 rows are the decode rows of a mixed step);
- fp8 / int4 caches hold `x @ R` (`KVCodec.rotation`): the query is rotated before the
  kernels and the output after, in fp32 torch, exactly as the reference does;
- H2O score collection (`meta.score_acc`): decode steps collect in the kernel (it stores the
  scaled scores; the probabilities come from the reduced log-sum-exp). Prefill and mixed
  steps that collect scores run the torch reference instead: its decayed per-query weights
  need the whole probability matrix of a chunk, which the flash-style prefill kernel never
  holds, and such steps are a small share of an H2O run (one per prompt chunk).

`decode_splits` is the one shape decision taken from Python ints (`meta.seq_lens_list`):
a CUDA graph captured with a metadata whose lengths are all `max_model_len` covers every
later replay (see `worker.model.cuda_graph`).
"""
from __future__ import annotations

import torch

from kvstore.quant import KVCache, QuantizedKV
from worker.kernels import reference
from worker.kernels.reference import AttnMetadata
from worker.kernels.triton_decode import TARGET_PROGRAMS, Splits, decode, plan_splits
from worker.kernels.triton_kv_write import write_kv
from worker.kernels.triton_prefill import prefill

__all__ = ["decode_splits", "paged_attention", "write_kv"]


def decode_splits(meta: AttnMetadata, num_kv_heads: int, sliding_window: int | None) -> Splits:
    """The split-K plan of a decode step: covers min(L, W) keys of its longest sequence."""
    max_keys = meta.max_seq_len if sliding_window is None else min(meta.max_seq_len, sliding_window)
    # the interpreter (CPU) runs programs one after another: two splits keep that path covered
    target = TARGET_PROGRAMS if meta.seq_lens.device.type == "cuda" else 2 * meta.num_seqs * num_kv_heads
    return plan_splits(meta.num_seqs, num_kv_heads, max_keys, target)


def paged_attention(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttnMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of this step's queries over the paged cache: `[T, Hq, D] -> [T, Hq, D]`
    (the contract of `reference.paged_attention`, score collection included)."""
    assert query.dim() == 3 and len(k_cache.shape) == 4 and k_cache.shape == v_cache.shape
    assert query.shape[0] == meta.num_tokens, (query.shape, meta.query_lens_list)
    assert sliding_window is None or sliding_window > 0, sliding_window
    if meta.score_acc is not None and not meta.is_decode:
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, allow_native=False)
    rot = k_cache.codec.rotation(query.device, torch.float32) if isinstance(k_cache, QuantizedKV) else None
    q = query if rot is None else (query.float() @ rot).to(query.dtype)
    if meta.is_decode:
        logits = None
        if meta.score_acc is not None:
            logits = torch.full((meta.num_seqs, query.shape[1], meta.max_seq_len), float("-inf"),  # [B, Hq, S]
                                dtype=torch.float32, device=query.device)
        out, lse = decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window,
                          decode_splits(meta, k_cache.shape[2], sliding_window), logits)
        if logits is not None:
            assert meta.score_acc is not None
            probs = torch.exp(logits - lse[:, :, None])  # [B, Hq, S]; 0 where nothing was attended
            meta.score_acc[:, :meta.max_seq_len] += probs.sum(dim=1)
    else:
        out = prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                      meta.max_query_len, scale, sliding_window)
    return out if rot is None else (out.float() @ rot).to(query.dtype)
