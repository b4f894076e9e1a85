"""The model on one device, run over the paged KV cache: `ModelRunner` loads the weights, sizes
and allocates the KV store, fits the int4 key calibration, captures decode CUDA graphs, and
runs a scheduled batch — the forward pass and the sampling of its next tokens.

The engine (`worker.engine.engine`) owns the loop and the requests; the runner owns the device
side. It reads the requests of a batch (their token ids, positions, block tables) and writes
only their logprobs; which requests finish, fork or are preempted is the engine's business.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from contracts.tokenizer import ModelTokenizer
from kvstore.disk_record import DiskSpec, fingerprint_of
from kvstore.keys import HashSalt
from kvstore.layout import KVLayout, KVQuant, resolve_kv_cache_dtype
from kvstore.store import KVStore
from worker.engine.config import DTYPE_NAMES, EngineConfig
from worker.engine.logprobs import PromptSpan, prompt_span, record_prompt_logprobs, record_sampled_logprobs
from worker.engine.request import Request
from worker.engine.sampling import Sampler, suppress_stop_tokens
from worker.engine.scheduler import ScheduledBatch
from worker.kernels import native
from worker.kernels.backend import attention_ops, resolve_backend
from worker.kernels.reference import AttnMetadata
from worker.model.calibration import CALIBRATION_TOKENS, cached_key_calibration, calibration_tokens
from worker.model.config import ModelConfig
from worker.model.cuda_graph import decode_graphs
from worker.model.llama import LlamaModel
from worker.model.loader import expected_weight_shapes, load_weights

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(_DTYPES) == DTYPE_NAMES


class ForwardOutput(NamedTuple):
    """One forward pass of a scheduled batch. `sample_reqs`: the requests whose newest token
    was computed (each samples its next one), in the row order of `logits` [len(sample_reqs),
    vocab] — or, with `all_positions`, `logits` has a row per new token of the batch.
    `score_acc`: the attention each cached token received, when the runner collects scores
    for token eviction (else None), with `seq_lens` the cache rows per request after the step."""

    sample_reqs: list[Request]
    logits: torch.Tensor
    score_acc: torch.Tensor | None
    seq_lens: list[int]


def _log_weights(weight_format: str, weight_bytes: int, mc: ModelConfig, layout: KVLayout, num_blocks: int,
                 from_budget: bool) -> None:
    """One startup line: the weights' format and real size, the KV pool, and the KV blocks the
    bytes they save over fp32 weights hold (what a Q4 model leaves for KV): part of the pool
    when it is sized from `--memory-gib`, else what that flag would add."""
    fp32_bytes = weight_bytes_fp32(mc)
    extra = layout.num_blocks_in(max(0, fp32_bytes - weight_bytes))
    log.info("weights %s: %.1f MiB (fp32: %.1f MiB); KV pool %d blocks%s; the %.1f MiB saved %s %d more KV blocks",
             weight_format, weight_bytes / 2**20, fp32_bytes / 2**20, num_blocks,
             " (--memory-gib less weights and activations)" if from_budget else "",
             (fp32_bytes - weight_bytes) / 2**20, "hold" if from_budget else "would hold (--memory-gib)", extra)


def activation_reserve_bytes(mc: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An upper estimate of one step's fp32 activations: per scheduled token the residual, the
    normed input, q/k/v, the attention output and the gate/up/activated MLP rows alive at once,
    and the logits of one token per sequence."""
    per_token = 3 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 3 * mc.intermediate_size
    return 4 * (max_num_batched_tokens * per_token + max_num_seqs * mc.vocab_size)


def kv_pool_blocks(cfg: EngineConfig, mc: ModelConfig, layout: KVLayout, weight_bytes: int) -> int:
    """The KV pool's blocks: `num_blocks`, else `kv_cache_memory_gib` of the layout, or with
    `memory_gib` what the weights at their real size and the activation reserve leave of it (so
    lighter weights give more blocks)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.memory_gib is None:
        return layout.num_blocks_in(int(cfg.kv_cache_memory_gib * 2**30))
    reserve = activation_reserve_bytes(mc, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    num_blocks = layout.num_blocks_in(max(0, int(cfg.memory_gib * 2**30) - weight_bytes - reserve))
    if num_blocks < 1:
        raise ValueError(f"memory_gib={cfg.memory_gib:g} leaves no room for a KV block: the weights take "
                         f"{weight_bytes / 2**30:.3f} GiB and a step's activations {reserve / 2**30:.3f} GiB")
    return num_blocks


def weight_bytes_fp32(mc: ModelConfig) -> int:
    """The model's weights in fp32 (every tensor of expected_weight_shapes)."""
    return 4 * sum(math.prod(s) for s in expected_weight_shapes(mc).values())


def resolve_device(name: str) -> torch.device:
    """`auto`: cuda when torch sees a GPU, else cpu."""
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


class ModelRunner:
    """Weights, KV tensors, CUDA graphs and the forward/sampling call of one engine.

    `store` is the KV store sized here for this model (`kv_pool_blocks`: `cfg.num_blocks`,
    else `cfg.kv_cache_memory_gib`, or what the weights leave of `cfg.memory_gib`); the engine's
    scheduler allocates its blocks, the runner writes and reads their tensors. `max_model_len` is
    capped so one sequence of it fits in the pool (vLLM checks the same): a smaller pool lowers it
    rather than admitting requests it cannot finish. `salt` keys the block hashes (model, tokenizer, KV dtype, block
    size, and `codec_id`, the int4 key calibration, "" without one), so that blocks are shared
    only between workers that encode alike.
    """

    def __init__(self, cfg: EngineConfig, model_dir: Path, device: torch.device,
                 tokenizer: ModelTokenizer | None) -> None:
        self.cfg = cfg
        self.device = device
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
        loaded = load_weights(model_dir, dtype=_DTYPES[dtype_name], device=device, weight_dtype=cfg.weight_dtype)
        mc = self.model_config = loaded.config
        self.weight_format, self.weight_bytes = loaded.weight_format, loaded.weight_bytes
        self.attention_backend = resolve_backend(cfg.attention_backend, device)
        self.model = LlamaModel(mc, loaded.weights, attention_ops(self.attention_backend))
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_size,
                               resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype_name))
        num_blocks = kv_pool_blocks(cfg, mc, self.layout, loaded.weight_bytes)
        _log_weights(loaded.weight_format, loaded.weight_bytes, mc, self.layout, num_blocks,
                     cfg.num_blocks is None and cfg.memory_gib is not None)
        model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.max_model_len = min(model_len, num_blocks * cfg.block_size)
        self.codec_id = ""
        if self.layout.quant is KVQuant.INT4 and cfg.kv_calibration:
            # int4 keys lose less through q·k when scaled per channel and centred
            # (worker.model.calibration); fitted over the model's context (capped), not the
            # pool's, so that every worker of one model gets the same scales
            tokens = calibration_tokens(tokenizer, mc.vocab_size, min(model_len, CALIBRATION_TOKENS))
            cal = cached_key_calibration(self.model, model_dir, tokens, cfg.block_size)
            self.model.set_key_scales(cal.scales, cal.shift)
            self.codec_id = "key-calibration:" + cal.digest()
        # KV computed with other weight formats differs: blocks are shared between workers of one format
        formats = sorted({f.split(" ")[0] for f in loaded.weight_format.split(", ")})
        model_key = mc.name if formats == [dtype_name] else f"{mc.name}@weights:{'+'.join(formats)}"
        self.salt = HashSalt(model=model_key, tokenizer=mc.name, kv_cache_dtype=self.layout.kv_cache_dtype,
                             block_size=cfg.block_size, kv_codec=self.codec_id).digest()
        disk = None
        if cfg.kv_disk_path and cfg.kv_disk_gib > 0:   # its records are keyed as the block hashes are salted
            disk = DiskSpec(cfg.kv_disk_path, int(cfg.kv_disk_gib * 2**30), fingerprint_of(self.salt, self.layout),
                            write_through=cfg.kv_disk_write_through)
        self.store = KVStore(self.layout, num_blocks, device, enable_prefix_caching=cfg.enable_prefix_caching,
                             offload_bytes=int(cfg.kv_offload_gib * 2**30),
                             copy_blocks=native.block_copier() if cfg.kv_offload_gib else None, disk=disk)
        self.kv_caches = list(zip(self.store.kv.k_caches, self.store.kv.v_caches, strict=True))
        # decode steps replay CUDA graphs (CUDA + triton backend, unless enforce_eager); None: eager
        self.cuda_graphs = decode_graphs(self.model, self.kv_caches, cfg.enforce_eager, cfg.max_num_seqs,
                                         self.max_model_len, cfg.block_size)
        ev = cfg.eviction_config()
        self.collect_scores = ev.enabled and ev.collects_scores
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.sampler = Sampler()

    def run(self, batch: ScheduledBatch, all_positions: bool = False) -> ForwardOutput:
        """Forward the batch: logits of the positions to sample from, or with `all_positions`
        of every new token. Records the prompt logprobs of the requests that asked for them."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []   # the token rows whose logits are computed
        sample_rows: list[int] = []      # of those, the rows sampled from
        spans: list[PromptSpan] = []     # prompt logprobs asked for
        sample_reqs: list[Request] = []
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))            # true positions, for RoPE
            seq_lens.append(start - req.num_evicted_tokens + n)  # cache rows after this step
            if req.needs_prompt_logits and not all_positions:
                span = prompt_span(req, start, n, len(ids) - n, len(logits_indices))
                if span is not None:
                    spans.append(span)
                    logits_indices.extend(span.token_rows)
            if start + n == req.num_tokens:
                sample_rows.append(len(logits_indices))
                logits_indices.append(len(ids) - 1)
                sample_reqs.append(req)
        meta = AttnMetadata.build(batch.num_new_tokens, seq_lens, [r.block_ids for r in batch.requests],
                                  self.cfg.block_size, self.device, collect_scores=self.collect_scores,
                                  score_decay=self.cfg.h2o_decay)
        dev = self.device
        self.store.fence_device()  # evicted blocks are rewritten only after their offload
        ids_t, positions_t = torch.tensor(ids, device=dev), torch.tensor(positions, device=dev)
        graphs = self.cuda_graphs
        if graphs is not None and graphs.supports(meta) and len(sample_rows) == meta.num_seqs == len(logits_indices):
            logits = graphs.run(ids_t, positions_t, meta)  # every row samples: the graph's logits are all rows
        else:
            logits = self.model.forward(ids_t, positions_t, self.kv_caches, meta, None if all_positions else
                                        torch.tensor(logits_indices, dtype=torch.long, device=dev))
        if spans:
            record_prompt_logprobs(spans, logits)
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        assert not self.collect_scores or meta.score_acc is not None
        return ForwardOutput(sample_reqs, logits, meta.score_acc if self.collect_scores else None, seq_lens)

    def sample(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[int]:
        """The next token of each request from its row of `logits` (stop tokens suppressed
        before `min_tokens`); records the sampled logprobs of those that asked for them."""
        params = [r.params for r in reqs]
        masked = suppress_stop_tokens(logits, params, [len(r.output_token_ids) for r in reqs], self.eos_token_ids)
        tokens: list[int] = self.sampler(masked, params, [r.history for r in reqs],
                                         [r.generator for r in reqs]).tolist()
        record_sampled_logprobs(reqs, logits, tokens)
        return tokens

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of every position of `token_ids` (teacher forcing).

        Runs as one prefill in blocks borrowed from the pool and freed before returning;
        raises OutOfBlocks when the pool cannot lend them now.
        """
        n = len(token_ids)
        blocks = self.store.allocate(self.layout.blocks_for(n))
        try:
            meta = AttnMetadata.build([n], [n], [blocks], self.cfg.block_size, self.device)
            return self.model.forward(torch.tensor(list(token_ids), device=self.device),
                                      torch.arange(n, device=self.device), self.kv_caches, meta)
        finally:
            self.store.free_sequence(blocks)
