"""Token eviction inside a running sequence's KV: StreamingLLM and H2O, off by default.

A sequence under a budget of `B` tokens keeps its cache between `B` and `B + block_size - 1`
tokens: once it reaches `B + block_size`, the policy names `B` tokens to keep, they are
compacted (in their original order) into `ceil(B / block_size)` blocks and the rest of its
blocks go back to the pool. Evicting one block's worth at a time keeps the copy cost at one
compaction per `block_size` tokens instead of one per step.

- `streaming` (StreamingLLM, Xiao et al. 2023): the first `sinks` tokens and the most
  recent `B - sinks`.
- `h2o` (Zhang et al. 2023): the first `sinks`, the most recent `(B - sinks) // 2`, and the
  rest of the budget by attention received: every forward pass adds the softmax weight
  each cached token received (summed over layers, query heads and new queries, see
  `AttnMetadata.score_acc`) to the sequence's score, and counts the queries that read it.
  Two departures from the paper, both chosen by perplexity at a 50% budget on 2,048 tokens
  of the bench text (CPython's LICENSE.txt) and of the pydoc topics text:
  * Tokens are ranked by their mean over the queries that read them (score / reads), not
    by the plain sum: a sum favours old tokens, which more queries have read, whatever
    their worth.
  * Score and reads decay by `h2o_decay` (default 0.98) per query, so the mean is weighted
    towards what recent queries attend to (TOVA and SnapKV rank by recent queries only).
    What it buys is measured by `kvmesh bench accuracy` (`h2o-50` against `h2o-50-nodecay`
    and `streaming-50`, same run); `--text` runs it on other texts. It is not a win
    everywhere: on some texts StreamingLLM scores better.
  One token set is kept for all layers and heads, because every layer shares the
  sequence's block table. Per-(layer, KV head) sets, as in the paper (compacted rows
  holding a different token per head; no per-head block table is needed when every head
  keeps exactly B), score clearly worse than the shared set on LICENSE.txt.

Positions: K is cached after RoPE, so a kept token keeps the rotation of its original
position; new tokens take their true positions (`num_computed_tokens`), so relative
distances between query and kept keys stay what they were. Attention reads the compacted
cache by physical length (`num_computed_tokens - num_evicted_tokens`).

Sharing: compaction never writes into a block someone else may read. It gathers the kept
rows first, frees every block the sequence holds (cached ones stay in the prefix cache,
unchanged) and writes into newly allocated blocks. After its first eviction a sequence
caches no more blocks: its cache no longer corresponds to a token prefix.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.pool import BlockPool
from kvstore.tensors import KVTensors
from worker.engine.request import Request
from worker.kernels.reference import query_weights


class EvictionPolicy(enum.Enum):
    NONE = "none"
    STREAMING = "streaming"
    H2O = "h2o"


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    policy: EvictionPolicy = EvictionPolicy.NONE
    kv_budget: int | None = None        # tokens kept per sequence
    attention_sinks: int = 4
    block_size: int = 16
    h2o_decay: float = 0.98             # per-query decay of H2O's attention sums (1: none)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, EvictionPolicy):
            raise ValueError(f"kv_eviction={self.policy!r}; accepted: none, streaming, h2o")
        if not 0.0 < self.h2o_decay <= 1.0:
            raise ValueError(f"h2o_decay={self.h2o_decay} must be in (0, 1]")
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks={self.attention_sinks} must be >= 0")
        if self.policy is EvictionPolicy.NONE:
            return
        if self.kv_budget is None:
            raise ValueError(f"kv_budget is required with kv_eviction={self.policy.value}")
        if self.kv_budget < self.attention_sinks + 2 * self.block_size:
            raise ValueError(f"kv_budget={self.kv_budget} must be >= attention_sinks + 2 * block_size "
                             f"= {self.attention_sinks + 2 * self.block_size}")

    @property
    def enabled(self) -> bool:
        return self.policy is not EvictionPolicy.NONE

    @property
    def collects_scores(self) -> bool:
        return self.policy is EvictionPolicy.H2O


def select_kept(policy: EvictionPolicy, num_tokens: int, budget: int, sinks: int,
                scores: torch.Tensor | None = None) -> torch.Tensor:
    """Physical indices (ascending, int64) of the `min(budget, num_tokens)` tokens to keep
    out of `num_tokens`; `scores` [num_tokens] is needed by H2O."""
    if num_tokens <= budget:
        return torch.arange(num_tokens)
    sinks = min(sinks, budget)
    if policy is EvictionPolicy.STREAMING:
        return torch.cat([torch.arange(sinks), torch.arange(num_tokens - (budget - sinks), num_tokens)])
    assert policy is EvictionPolicy.H2O, policy
    assert scores is not None and scores.shape == (num_tokens,), (None if scores is None else scores.shape)
    recent = (budget - sinks) // 2
    heavy = budget - sinks - recent
    middle = scores[sinks:num_tokens - recent]                      # candidates for heavy hitters
    top = torch.topk(middle, heavy, sorted=False).indices + sinks   # ties: topk's choice
    kept = torch.cat([torch.arange(sinks), top.sort().values, torch.arange(num_tokens - recent, num_tokens)])
    return kept


class TokenEvictor:
    """Applies the policy to running sequences after each step (see the module docstring).

    Holds each evicting sequence's H2O scores and read counts [physical length] by request id."""

    def __init__(self, cfg: EvictionConfig, pool: BlockPool, kv: KVTensors) -> None:
        assert cfg.block_size == kv.layout.block_size
        self.cfg = cfg
        self.pool = pool
        self.kv = kv
        self.scores: dict[str, torch.Tensor] = {}   # attention received, summed
        self.reads: dict[str, torch.Tensor] = {}    # queries that read each token
        self.num_compactions = 0
        self.num_evicted_tokens = 0

    def accumulate(self, reqs: Sequence[Request], score_acc: torch.Tensor, seq_lens: Sequence[int],
                   query_lens: Sequence[int]) -> None:
        """Add this step's attention weights (`score_acc[i, :seq_lens[i]]`) to each sequence's,
        and its `query_lens[i]` new queries to the read counts (causal: new token j of q is
        read by queries j .. q - 1), every query weighted `h2o_decay ** age` like the kernel
        weighs it in `score_acc`; what was there before ages by q."""
        decay = self.cfg.h2o_decay
        for i, (req, n, q) in enumerate(zip(reqs, seq_lens, query_lens)):
            new = score_acc[i, :n].to("cpu", torch.float32)            # [n]
            weight = query_weights(q, decay)                            # [q], as the kernel weighs them
            reads = torch.full((n,), float(weight.sum()))               # read by all q new queries
            reads[n - q:] = weight.flip(0).cumsum(0).flip(0)            # new token j: by queries j ..
            old, old_reads = self.scores.get(req.request_id), self.reads.get(req.request_id)
            if old is not None and old_reads is not None:
                age = decay ** q
                new[:old.shape[0]] += old[:n] * age
                reads[:old_reads.shape[0]] += old_reads[:n] * age
            self.scores[req.request_id] = new
            self.reads[req.request_id] = reads

    def after_step(self, reqs: Sequence[Request]) -> None:
        """Compact every sequence that reached `kv_budget + block_size` cached tokens."""
        budget, bs = self.cfg.kv_budget, self.cfg.block_size
        assert budget is not None
        for req in reqs:
            n = req.num_computed_tokens - req.num_evicted_tokens      # physical length
            if n >= budget + bs:
                self._compact(req, n, budget)

    def forget(self, req: Request) -> None:
        """The request finished or was preempted (its cache is gone)."""
        self.scores.pop(req.request_id, None)
        self.reads.pop(req.request_id, None)

    def _compact(self, req: Request, n: int, budget: int) -> None:
        bs = self.cfg.block_size
        scores, reads = self.scores.get(req.request_id), self.reads.get(req.request_id)
        rank = None
        if self.cfg.collects_scores:
            assert scores is not None and reads is not None and scores.shape[0] >= n, \
                "H2O scores missing for a running sequence"
            scores, reads = scores[:n], reads[:n]
            rank = scores / reads.clamp(min=1)                      # mean attention per reading query
        kept = select_kept(self.cfg.policy, n, budget, self.cfg.attention_sinks, rank)     # [budget]
        held = req.held_block_ids
        assert len(held) == len(req.block_ids) and len(held) * bs >= n, "evicting sequence lost blocks"
        table = torch.tensor(held, dtype=torch.int64)
        src_slots = table[kept // bs] * bs + kept % bs                                     # [budget]
        flat = self.kv.kv.flatten(2, 3)                             # [L, 2, N*bs, H, D | bytes]
        rows = flat.index_select(2, src_slots)                      # [L, 2, budget, H, D | bytes]
        self.pool.free_sequence(held)   # cached blocks stay cached; nothing is written into them
        new_blocks = self.pool.allocate(-(-budget // bs))
        dst_slots = (torch.tensor(new_blocks, dtype=torch.int64)[:, None] * bs
                     + torch.arange(bs)).flatten()[:budget]         # [budget]
        flat.index_copy_(2, dst_slots, rows)
        req.block_ids = list(new_blocks)
        req.num_evicted_tokens += n - budget
        if scores is not None and reads is not None:
            self.scores[req.request_id] = scores[kept].clone()
            self.reads[req.request_id] = reads[kept].clone()
        self.num_compactions += 1
        self.num_evicted_tokens += n - budget
