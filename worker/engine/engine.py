"""The engine of one worker: `step()` is the whole loop — schedule → run → postprocess.

`Engine` is synchronous and single-threaded; the gRPC server drives it from one thread
(`worker.engine.async_engine`). Its KV blocks — device pool, paged tensors, host tier, events — are
one `kvstore.store.KVStore` (`engine.store`), which the scheduler and the peer plane use.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from contracts.requests import NO_TENANT, TenantShare, context_length_error
from contracts.tokenizer import TokenizerError
from kvstore.keys import HashSalt, cache_salt_root
from kvstore.layout import KVLayout, KVQuant, resolve_kv_cache_dtype
from kvstore.store import KVStore
from worker.model.calibration import CALIBRATION_TOKENS, cached_key_calibration, calibration_tokens
from worker.model.cuda_graph import decode_graphs
from worker.kernels import native
from worker.kernels.backend import attention_ops, resolve_backend
from worker.kernels.reference import AttnMetadata
from worker.model.loader import load_tokenizer, load_weights, resolve_model_dir
from worker.engine.config import DTYPE_NAMES, EngineConfig, EngineStats
from worker.engine.eviction import TokenEvictor
from worker.engine.fork import fork_sequences
from worker.engine.logprobs import (PromptSpan, prompt_span, record_prompt_logprobs, record_sampled_logprobs,
                             take_unsent_logprobs)
from worker.model.llama import LlamaModel
from worker.engine.resume import resume
from worker.engine.request import (MAX_PRIORITY, MIN_PRIORITY, EngineError, FinishReason, InvalidRequest,
                            QueueFull, Request, RequestOutput, RequestStatus)
from worker.engine.sampling import Sampler, SamplingParams, check_stop_token, find_stop, make_generator, suppress_stop_tokens
from worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(_DTYPES) == DTYPE_NAMES

Prompt = str | Sequence[int]


class Scores(NamedTuple):
    """Teacher-forced results per position t of a text: `nll[t]` of token t + 1, `argmax[t]`."""

    nll: torch.Tensor
    argmax: torch.Tensor


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bf16" if self.device.type == "cuda" else "fp32")
        self.model_dir = resolve_model_dir(cfg.model)
        loaded = load_weights(self.model_dir, dtype=_DTYPES[dtype_name], device=self.device)
        self.model_config = loaded.config
        self.attention_backend = resolve_backend(cfg.attention_backend, self.device)  # reported by bench / model info
        self.model = LlamaModel(loaded.config, loaded.weights, attention_ops(self.attention_backend))
        self.tokenizer = load_tokenizer(self.model_dir) if _has_tokenizer(self.model_dir) else None
        mc = loaded.config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_size,
                               resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype_name))
        num_blocks = cfg.num_blocks or self.layout.num_blocks_in(int(cfg.kv_cache_memory_gib * 2**30))
        # One sequence of max_model_len tokens must fit in the pool (vLLM checks the same):
        # a smaller pool lowers max_model_len rather than admitting requests it cannot finish.
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings,
                                 num_blocks * cfg.block_size)
        codec_id = ""
        if self.layout.quant is KVQuant.INT4 and cfg.kv_calibration:
            # int4 keys lose less through q·k when scaled per channel and centred (worker.model.calibration);
            # fitted over the model's context (capped), not the pool's, so that every worker
            # of one model gets the same scales
            context = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings,
                          CALIBRATION_TOKENS)
            cal = cached_key_calibration(self.model, self.model_dir, calibration_tokens(
                self.tokenizer, mc.vocab_size, context), cfg.block_size)
            self.model.set_key_scales(cal.scales, cal.shift)
            codec_id = "key-calibration:" + cal.digest()
        self.store = KVStore(self.layout, num_blocks, self.device, enable_prefix_caching=cfg.enable_prefix_caching,
                             offload_bytes=int(cfg.kv_offload_gib * 2**30), copy_blocks=native.block_copier() if cfg.kv_offload_gib else None)
        self.kv_caches = list(zip(self.store.kv.k_caches, self.store.kv.v_caches))
        # decode steps replay CUDA graphs (CUDA + triton backend, unless enforce_eager); None: eager
        self.cuda_graphs = decode_graphs(self.model, self.kv_caches, cfg.enforce_eager, cfg.max_num_seqs,
                                         self.max_model_len, cfg.block_size)
        self.salt = HashSalt(model=mc.name, tokenizer=mc.name, kv_cache_dtype=self.layout.kv_cache_dtype,
                             block_size=cfg.block_size, kv_codec=codec_id).digest()
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            cfg.enable_chunked_prefill, mc.sliding_window, cfg.enable_prefix_caching,
                            cfg.fair_share, cfg.fair_step_tokens, cfg.tenant_max_cached_frac),
            self.store, self.salt)
        ev = cfg.eviction_config()
        if ev.enabled and mc.sliding_window is not None:
            raise ValueError(f"kv_eviction={cfg.kv_eviction}: this model has a sliding window "
                             f"({mc.sliding_window}); its blocks are already released behind it")
        self.evictor = TokenEvictor(ev, self.store.pool, self.store.kv) if ev.enabled else None
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise InvalidRequest("this model has no chat template")
        try:
            return self.tokenizer.apply_chat_template(messages)
        except TokenizerError as e:   # the template's raise_exception (e.g. roles out of order)
            raise InvalidRequest(str(e)) from None

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str = "", fit_context: bool = False,
                    resume_tokens: int = 0, tenant: TenantShare = NO_TENANT) -> str:
        """Validate and queue one request; raises InvalidRequest / QueueFull, queuing nothing.
        Lower `priority` is admitted first (in [MIN_PRIORITY, MAX_PRIORITY]). `cache_salt`
        keys its blocks apart from other salts' (kvstore.keys.cache_salt_root). With
        `fit_context`, a prompt plus `max_tokens` beyond max_model_len is an InvalidRequest
        instead of a generation cut at max_model_len. `resume_tokens` > 0: the last that many
        ids of `prompt` are output a previous worker already generated and reported (a migrated
        request); they count as output everywhere (see `worker.engine.resume`)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        ids = self.encode(prompt)
        resumed: list[int] = []
        if resume_tokens:
            if not 0 < resume_tokens < len(ids):
                raise InvalidRequest(f"resume_tokens={resume_tokens} must be in [0, {len(ids)}) (the prompt's length)")
            ids, resumed = ids[:-resume_tokens], ids[-resume_tokens:]
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        if self.evictor is not None and params.num_sequences > 1:   # evicted caches are per sequence
            raise InvalidRequest(f"n / best_of: {params.num_sequences} sequences with kv_eviction on; use 1")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})")
        if resumed and params.num_sequences > 1:
            raise InvalidRequest("resume_tokens: only for a single sequence (n = best_of = 1)")
        if resumed and (any(t < 0 or t >= vocab for t in resumed) or len(resumed) >= params.max_tokens):
            raise InvalidRequest(f"resumed token ids must be in [0, {vocab}) and fewer than max_tokens")
        if len(ids) + len(resumed) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(ids) + len(resumed)} tokens; this model takes at most "
                                 f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        if fit_context and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(context_length_error(self.max_model_len, len(ids), params.max_tokens))
        max_total = min(len(ids) + params.max_tokens, self.max_model_len)
        if len(self.scheduler.waiting) >= self.cfg.max_queue_len:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests waiting (max_queue_len)")
        req = Request(request_id, ids, params, max_total, make_generator(params.seed, self.device), priority,
                      cache_salt_root(cache_salt), tenant=tenant)
        if resumed:
            resume(req, resumed, self.tokenizer, self.model_config.vocab_size, self.device)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (every sequence of it) and free its blocks; returns its final
        output (None if unknown)."""
        group = [r for r in self.requests.values() if r.group_id == request_id]
        if not group and request_id in self.requests:
            group = [self.requests[request_id]]
        for req in group:
            self._finish(req, FinishReason.ABORT)
        return self._output(group[-1]) if group else None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        del self.requests[req.request_id]
        if self.evictor is not None:
            self.evictor.forget(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        sample_reqs, logits = self._execute(batch)
        outputs: list[RequestOutput] = []
        if any(r.params.max_tokens == 0 for r in sample_reqs):   # prompt logprobs only (echo)
            keep = [i for i, r in enumerate(sample_reqs) if r.params.max_tokens > 0]
            for req in sample_reqs:
                if req.params.max_tokens == 0:
                    self._finish(req, FinishReason.LENGTH)
                    outputs.append(self._output(req))
            sample_reqs, logits = [sample_reqs[i] for i in keep], logits[keep]
        if sample_reqs:
            sample_reqs, logits = fork_sequences(sample_reqs, logits, self.scheduler, self.requests, self.device)
            raw = logits
            logits = suppress_stop_tokens(logits, [r.params for r in sample_reqs],
                                          [len(r.output_token_ids) for r in sample_reqs], self.eos_token_ids)
            tokens = self.sampler(logits, [r.params for r in sample_reqs],
                                  [r.history for r in sample_reqs], [r.generator for r in sample_reqs]).tolist()
            record_sampled_logprobs(sample_reqs, raw, tokens)
            for req, token in zip(sample_reqs, tokens):
                req.append_token(token)
                req.update_block_hashes(self.cfg.block_size, self.salt)
                reason = self._postprocess(req, token)
                if reason is not None:
                    self._finish(req, reason)
                outputs.append(self._output(req))
        if self.cfg.check_integrity:
            self.check_integrity()
        return outputs

    def _execute(self, batch: ScheduledBatch, all_positions: bool = False) -> tuple[list[Request], torch.Tensor]:
        """Run a scheduled batch and account for it: the forward pass, computed counts and
        cached blocks, token eviction. Returns `_run`'s result."""
        if self.evictor is not None:
            for req in batch.preempted:
                self.evictor.forget(req)
        out = self._run(batch, all_positions)
        self.scheduler.update_computed(batch)
        if self.evictor is not None:
            self.evictor.after_step(batch.requests)
        return out

    def _run(self, batch: ScheduledBatch, all_positions: bool = False) -> tuple[list[Request], torch.Tensor]:
        """Forward the batch; logits of the positions to sample from, or with `all_positions`
        of every new token."""
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []   # the token rows whose logits are computed
        sample_rows: list[int] = []      # of those, the rows sampled from
        spans: list[PromptSpan] = []     # prompt logprobs asked for
        sample_reqs: list[Request] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
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
        collect = self.evictor is not None and self.evictor.cfg.collects_scores
        meta = AttnMetadata.build(batch.num_new_tokens, seq_lens, [r.block_ids for r in batch.requests],
                                  self.cfg.block_size, self.device, collect_scores=collect,
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
        if collect:
            assert self.evictor is not None and meta.score_acc is not None
            self.evictor.accumulate(batch.requests, meta.score_acc, seq_lens, batch.num_new_tokens)
        if spans:
            record_prompt_logprobs(spans, logits)
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return sample_reqs, logits

    def _postprocess(self, req: Request, token: int) -> FinishReason | None:
        """Detokenize and apply stop conditions; returns why the request ends, if it does."""
        reason = check_stop_token(token, len(req.output_token_ids), req.params, self.eos_token_ids)
        if reason is None and req.num_tokens >= req.max_total_tokens:
            reason = "length"
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens,
                                         spaces_between_special_tokens=req.params.spaces_between_special_tokens)
            if req.params.stop and len(req.output_token_ids) >= req.params.min_tokens:
                at = find_stop(text, req.sent_text, req.params.stop)
                if at is not None:
                    stop_len = next(len(s) for s in req.params.stop if text.startswith(s, at))
                    text = text[:at + stop_len] if req.params.include_stop_str_in_output else text[:at]
                    reason = "stop"
            req.output_text = text
        return FinishReason(reason) if reason is not None else None

    def _output(self, req: Request) -> RequestOutput:
        finished = req.status is RequestStatus.FINISHED
        text = req.output_text
        # Hold back a trailing partial UTF-8 character until the next token completes it.
        visible = len(text) if finished or not text.endswith("\ufffd") else len(text.rstrip("\ufffd"))
        new_tokens = tuple(req.output_token_ids[req.sent_tokens:])
        new_text = text[req.sent_text:visible]
        req.sent_tokens = len(req.output_token_ids)
        req.sent_text = max(req.sent_text, visible)
        new_logprobs, prompt_logprobs = take_unsent_logprobs(req)
        group_finished = finished and not any(r.group_id == req.group_id for r in self.requests.values())
        return RequestOutput(
            request_id=req.group_id, token_ids=tuple(req.output_token_ids), new_token_ids=new_tokens,
            text=text[:visible], new_text=new_text, finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(req.output_token_ids),
            num_cached_tokens=max(req.num_cached_tokens, 0), timings=req.timings(), index=req.index,
            new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs,
            cumulative_logprob=req.cumulative_logprob if req.params.wants_logprobs else None,
            group_finished=group_finished)

    # -- conveniences ---------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion as one continuous batch; outputs in prompt order."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if not plist:   # [] is a prompt of zero tokens (e.g. a text the tokenizer maps to nothing)
            raise InvalidRequest("prompt is empty (zero tokens)")
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(plist)
        if len(params_list) != len(plist):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(plist)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(plist, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield one output per new token of this request while stepping the whole engine."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

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

    def measure_prefill(self, num_tokens: int) -> float:
        """Prefill tokens/s: a `num_tokens` prompt of random ids run to its first token, after a
        short warm-up. The engine must be idle and not driven by another thread; the prefix
        cache is emptied afterwards (the probe's blocks would match nothing real)."""
        n = max(1, min(num_tokens, self.max_model_len - 2))
        vocab = self.model_config.vocab_size
        rng = random.Random(0)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        self.generate([rng.randrange(vocab // 4, vocab // 2) for _ in range(min(16, n))], one)
        ids = [rng.randrange(vocab // 4, vocab // 2) for _ in range(n)]
        t0 = time.perf_counter()
        self.generate(ids, one)
        seconds = time.perf_counter() - t0
        self.store.reset_prefix_cache()
        return n / seconds

    def score(self, token_ids: Sequence[int], chunk_size: int) -> Scores:
        """Next-token NLL and argmax [T - 1] of `token_ids`, teacher-forced `chunk_size` tokens at a time
        through the running-sequence path, so token eviction and window release happen
        between chunks as they would in a generation. The engine must be idle."""
        if self.has_unfinished():
            raise EngineError("score() needs an idle engine")
        ids = [int(t) for t in token_ids]
        if not 2 <= len(ids) <= self.max_model_len or chunk_size <= 0:
            raise InvalidRequest(f"score: {len(ids)} tokens (max_model_len {self.max_model_len}), "
                                 f"chunk_size {chunk_size}")
        req = Request(f"score-{next(self._ids)}", ids[:chunk_size], SamplingParams(max_tokens=1),
                      len(ids), None)
        self.scheduler.add(req)
        target = torch.tensor(ids[1:] + [-100], device=self.device)   # -100: the last has none
        nll: list[torch.Tensor] = []
        argmax: list[torch.Tensor] = []
        try:
            while req.num_computed_tokens < len(ids):
                batch = self.scheduler.schedule()
                if not batch.requests:
                    raise EngineError("score(): the KV pool cannot hold the sequence")
                start = req.num_computed_tokens
                _, logits = self._execute(batch, all_positions=True)   # [n, vocab]
                nll.append(F.cross_entropy(logits, target[start:start + logits.shape[0]], reduction="none",
                                           ignore_index=-100))
                argmax.append(logits.argmax(-1))
                if req.num_computed_tokens == req.num_tokens < len(ids):
                    for t in ids[req.num_tokens:req.num_tokens + chunk_size]:
                        req.append_token(t)
                    req.update_block_hashes(self.cfg.block_size, self.salt)
        finally:
            self.scheduler.finish(req, FinishReason.LENGTH)
            if self.evictor is not None:
                self.evictor.forget(req)
        return Scores(torch.cat(nll)[:-1], torch.cat(argmax)[:-1])

    def stats(self) -> EngineStats:
        u = self.store.usage()
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), u.num_free_blocks,
                           u.num_used_blocks, u.num_blocks, u.prefix_query_blocks, u.prefix_hit_blocks,
                           self.scheduler.num_preemptions, u.num_host_blocks, u.host_num_blocks,
                           u.num_onloaded_blocks,
                           self.store.host.stats().offloaded if self.store.host is not None else 0,
                           self.store.pool.stats().evictions,
                           self.evictor.num_evicted_tokens if self.evictor is not None else 0,
                           u.num_cached_blocks, u.num_protected_blocks, u.num_reused_blocks,
                           self.scheduler.num_prefix_waits)

    def check_integrity(self) -> None:
        """The store's invariants, and every device block reference held by a running request."""
        self.store.check_integrity(req.held_block_ids for req in self.scheduler.running)


def _has_tokenizer(model_dir: Any) -> bool:
    return any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


__all__ = ["Engine", "EngineConfig", "EngineError", "EngineStats", "InvalidRequest", "QueueFull",
           "RequestOutput", "SamplingParams"]
