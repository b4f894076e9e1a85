"""CUDA graphs for decode: capture the model's decode step once per batch-size bucket, then
each decode step pads its batch to the bucket, copies its inputs into the bucket's static
buffers and replays — one launch instead of one per op per layer. Prefill stays eager;
`--enforce-eager` (vLLM's flag) turns graphs off.

Buckets are 1, 2, 4, 8, ... up to `max_num_seqs` (and `max_num_seqs` itself). A step uses
a graph when every sequence brings one token, no attention scores are collected (H2O runs
eager) and the batch fits the largest bucket.

What makes a decode step capturable: the Triton backend reads lengths from tensors, never
from Python ints, except its split-K plan (`triton_attention.decode_splits`), which the
capture fixes for `max_model_len` keys; the static metadata therefore claims every row is
`max_model_len` long, and the real lengths arrive in `seq_lens` at replay. Padded rows
write their K/V nowhere (slot -1, which the Triton KV-write kernel skips) and attend to
one key of block 0 (any finite value); their logits are dropped. The torch backend plans
its gathers from Python lengths and is never captured.

Who owns what: the runner owns the static buffers, the graphs and their memory pool; the
logits a replay returns are a view into the bucket's output buffer, valid until the next
replay (the engine samples from them before the next step).

`StaticDecode` (buffers, padding and the forward a graph captures) runs on any device, so
the CPU tests check the padding against an unpadded eager forward; `CudaGraphRunner` adds
the capture and needs CUDA.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvstore.quant import KVCache
from worker.kernels.backend import AttentionBackend
from worker.kernels.reference import AttnMetadata
from worker.model.llama import LlamaModel

log = logging.getLogger(__name__)

PAD_SLOT = -1  # a padded row's slot: the KV-write kernel skips it


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets: powers of two below `max_num_seqs`, then `max_num_seqs`."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be positive")
    sizes = []
    n = 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return (*sizes, max_num_seqs)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows (`sizes` ascending), or None if none does."""
    return next((s for s in sizes if s >= num_seqs), None)


class StaticDecode:
    """The padded decode forward of one bucket over static buffers: what a graph captures.

    `load(input_ids, positions, meta)` copies a decode step of n <= size rows into the
    buffers and pads rows n..size-1; `forward()` runs the model on the buffers and returns
    logits [size, vocab].
    """

    def __init__(self, model: LlamaModel, kv_caches: Sequence[tuple[KVCache, KVCache]], size: int,
                 max_model_len: int, block_size: int) -> None:
        dev = model.device
        self.model, self.kv_caches, self.size = model, kv_caches, size
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.meta = AttnMetadata(
            slot_mapping=torch.full((size,), PAD_SLOT, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(size + 1, dtype=torch.int64, device=dev),
            seq_lens=torch.ones(size, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(size, self.max_blocks, dtype=torch.int64, device=dev),
            query_lens_list=[1] * size, seq_lens_list=[max_model_len] * size)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> None:
        """Copy a decode step's inputs (n rows) into the buffers; rows n.. become padding."""
        n = meta.num_seqs
        width = meta.block_tables.shape[1]
        assert meta.is_decode and n <= self.size and width <= self.max_blocks, (n, self.size, width)
        m = self.meta
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        m.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        m.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        m.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < self.size:
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            m.slot_mapping[n:].fill_(PAD_SLOT)
            m.seq_lens[n:].fill_(1)
            m.block_tables[n:, 0].zero_()

    def forward(self) -> torch.Tensor:
        return self.model.forward(self.input_ids, self.positions, self.kv_caches, self.meta)  # [size, vocab]


class _Graph(NamedTuple):
    static: StaticDecode
    graph: torch.cuda.CUDAGraph | None  # None: not captured (`capture=False`), the forward runs eagerly
    logits: torch.Tensor | None  # [size, vocab], written by every replay


class CudaGraphRunner:
    """Captured decode steps, one per bucket of `capture_sizes(max_num_seqs)`.

    `capture=False` builds the same buckets and static buffers without capturing, and `run`
    then calls the bucket's forward eagerly: the engine's graph path, padding included, on a
    device without CUDA graphs (the CPU tests use it with the Triton interpreter).
    """

    def __init__(self, model: LlamaModel, kv_caches: Sequence[tuple[KVCache, KVCache]], max_num_seqs: int,
                 max_model_len: int, block_size: int, capture: bool = True) -> None:
        assert not capture or model.device.type == "cuda", "CUDA graphs need a CUDA model"
        assert model.attention.backend is AttentionBackend.TRITON, "only the Triton backend is capturable"
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, _Graph] = {}
        if not capture:
            for size in self.sizes:
                self.graphs[size] = _Graph(StaticDecode(model, kv_caches, size, max_model_len, block_size), None, None)
            return
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            static = StaticDecode(model, kv_caches, size, max_model_len, block_size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the Triton kernels and warm the allocator outside the capture
                    static.forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = static.forward()
            self.graphs[size] = _Graph(static, graph, logits)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, self.sizes)))

    def supports(self, meta: AttnMetadata) -> bool:
        """Whether this step can replay a graph (decode, no score collection, fits a bucket)."""
        return meta.is_decode and meta.score_acc is None and meta.num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Replay the bucket's graph on this step: logits [n, vocab] (a view, valid until the
        next replay). Check `supports(meta)` first."""
        size = bucket_for(meta.num_seqs, self.sizes)
        assert size is not None and self.supports(meta), (meta.num_seqs, self.sizes)
        g = self.graphs[size]
        g.static.load(input_ids, positions, meta)
        if g.graph is None:
            return g.static.forward()[:meta.num_seqs]
        g.graph.replay()
        assert g.logits is not None
        return g.logits[:meta.num_seqs]


def decode_graphs(model: LlamaModel, kv_caches: Sequence[tuple[KVCache, KVCache]], enforce_eager: bool,
                  max_num_seqs: int, max_model_len: int, block_size: int) -> CudaGraphRunner | None:
    """The engine's graph runner: captured on CUDA with the Triton backend unless
    `enforce_eager`; None (eager decode) otherwise."""
    if enforce_eager or model.device.type != "cuda":
        return None
    if model.attention.backend is not AttentionBackend.TRITON:
        log.info("decode runs eager: CUDA graphs need --attention-backend triton (have %s)",
                 model.attention.backend.value)
        return None
    return CudaGraphRunner(model, kv_caches, max_num_seqs, max_model_len, block_size)
