"""The engine of one worker: `step()` is the whole loop — schedule → run → postprocess:
the scheduler picks the batch, the model runner (`worker.model.runner.ModelRunner`) runs the
forward pass and samples, the engine appends the tokens, applies the stop conditions and
hands out the outputs.

`Engine` is synchronous and single-threaded; the gRPC server drives it from one thread
(`worker.engine.async_engine`). Its KV blocks — device pool, paged tensors, host tier, events — are
one `kvstore.store.KVStore` (`engine.store`, sized and allocated by the runner), which the
scheduler and the peer plane use. A request arrives as one spec, contracts `GenerateInput`
(`add_request`; `worker.engine.request.prompt_input` builds one from a prompt).
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from contracts.requests import GenerateInput, context_length_error
from contracts.tokenizer import TokenizerError
from kvstore.keys import cache_salt_root
from worker.engine.config import EngineConfig, EngineStats
from worker.engine.eviction import TokenEvictor
from worker.engine.fork import fork_sequences
from worker.engine.logprobs import take_unsent_logprobs
from worker.engine.request import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    EngineError,
    FinishReason,
    InvalidRequest,
    Prompt,
    QueueFull,
    Request,
    RequestOutput,
    RequestStatus,
    prompt_input,
)
from worker.engine.resume import resume
from worker.engine.sampling import SamplingParams, check_stop_token, find_stop, make_generator
from worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from worker.model.loader import load_tokenizer, resolve_model_dir
from worker.model.runner import ForwardOutput, ModelRunner, resolve_device


class Scores(NamedTuple):
    """Teacher-forced results per position t of a text: `nll[t]` of token t + 1, `argmax[t]`."""

    nll: torch.Tensor
    argmax: torch.Tensor


class Engine:
    """Requests in, outputs out, one `step()` at a time. `runner` holds the model and its KV
    store (`store`, shared with the scheduler and the peer plane); `salt` keys this worker's
    block hashes (model, tokenizer, KV dtype, block size and key calibration)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.model_dir = resolve_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir) if _has_tokenizer(self.model_dir) else None
        self.runner = ModelRunner(cfg, self.model_dir, self.device, self.tokenizer)
        mc = self.model_config = self.runner.model_config
        self.layout, self.max_model_len, self.store = self.runner.layout, self.runner.max_model_len, self.runner.store
        self.salt = self.runner.salt
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            cfg.enable_chunked_prefill, mc.sliding_window, cfg.enable_prefix_caching,
                            cfg.fair_share, cfg.fair_step_tokens, cfg.tenant_max_cached_frac,
                            cfg.step_prefill_tokens, cfg.room_wait_steps),
            self.store, self.salt)
        ev = cfg.eviction_config()
        if ev.enabled and mc.sliding_window is not None:
            raise ValueError(f"kv_eviction={cfg.kv_eviction}: this model has a sliding window "
                             f"({mc.sliding_window}); its blocks are already released behind it")
        self.evictor = TokenEvictor(ev, self.store.pool, self.store.kv) if ev.enabled else None
        self.eos_token_ids = self.runner.eos_token_ids
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # called on the engine thread once a step is scheduled, before its forward pass: the blocks
        # its admissions evicted are known then, and the worker publishes them without waiting
        # out the forward (seconds of prefill on a CPU), so the router stops predicting hits on them
        self.after_schedule: Callable[[], None] | None = None

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

    def prompt_ids(self, spec: GenerateInput) -> list[int]:
        """The token ids of the spec's prompt: its token ids, its text encoded, or its chat
        messages through the model's chat template."""
        if sum(p is not None for p in (spec.text, spec.token_ids, spec.chat)) != 1:
            raise InvalidRequest("set exactly one of text, token_ids, chat")
        if spec.chat is not None:
            return self.apply_chat_template([{"role": m.role, "content": m.content} for m in spec.chat])
        return self.encode(spec.text if spec.text is not None else spec.token_ids or ())

    def add_request(self, spec: GenerateInput) -> str:
        """Validate and queue one request; raises InvalidRequest / QueueFull, queuing nothing.
        Returns its id (`spec.request_id`, or a new one when that is empty). Lower `priority`
        is admitted first (in [MIN_PRIORITY, MAX_PRIORITY]). `cache_salt` keys its blocks apart
        from other salts' (kvstore.keys.cache_salt_root). With `max_tokens_given`, a prompt
        plus `max_tokens` beyond max_model_len is an InvalidRequest instead of a generation cut
        at max_model_len. `resume_tokens` > 0: the last that many ids of the prompt are output
        a previous worker already generated and reported (a migrated request); they count as
        output everywhere (see `worker.engine.resume`). `peer_hints` are the server's business
        (worker.peer.plane), not the engine's."""
        priority, resume_tokens, params = spec.priority, spec.resume_tokens, spec.params
        if spec.shared_prefix_blocks < 0:
            raise InvalidRequest(f"shared_prefix_blocks={spec.shared_prefix_blocks} must be >= 0")
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        ids = self.prompt_ids(spec)
        resumed: list[int] = []
        if resume_tokens:
            if not 0 < resume_tokens < len(ids):
                raise InvalidRequest(f"resume_tokens={resume_tokens} must be in [0, {len(ids)}) (the prompt's length)")
            ids, resumed = ids[:-resume_tokens], ids[-resume_tokens:]
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        request_id = spec.request_id or f"req-{next(self._ids)}"
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
        if spec.max_tokens_given and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(context_length_error(self.max_model_len, len(ids), params.max_tokens))
        max_total = min(len(ids) + params.max_tokens, self.max_model_len)
        if len(self.scheduler.waiting) >= self.cfg.max_queue_len:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests waiting (max_queue_len)")
        req = Request(request_id, ids, params, max_total, make_generator(params.seed, self.device), priority,
                      cache_salt_root(spec.cache_salt), tenant=spec.tenant, prefill_only=spec.prefill_only,
                      shared_prefix_blocks=min(spec.shared_prefix_blocks, len(ids) // self.cfg.block_size))
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
            self.store.wait_for_disk(0.02)   # waiting requests' prefixes being read back from disk
            return []
        if self.after_schedule is not None:
            self.after_schedule()
        forward = self._execute(batch)
        sample_reqs, logits = forward.sample_reqs, forward.logits
        outputs: list[RequestOutput] = []
        # a prefill-only request reports each chunk it computed: those blocks are cached, and fetchable
        prefilling = [r for r in batch.requests if r.prefill_only]
        if prefilling:
            done = {id(r) for r in sample_reqs}
            outputs = [self._output(r) for r in prefilling if id(r) not in done]
        # prompt logprobs only (echo), or a prefill-only request (disaggregated serving): no sampling
        if any(r.params.max_tokens == 0 or r.prefill_only for r in sample_reqs):
            keep = [i for i, r in enumerate(sample_reqs) if r.params.max_tokens > 0 and not r.prefill_only]
            for req in sample_reqs:
                if req.params.max_tokens == 0 or req.prefill_only:
                    self._finish(req, FinishReason.LENGTH)
                    outputs.append(self._output(req))
            sample_reqs, logits = [sample_reqs[i] for i in keep], logits[keep]
        if sample_reqs:
            sample_reqs, logits = fork_sequences(sample_reqs, logits, self.scheduler, self.requests, self.device)
            tokens = self.runner.sample(sample_reqs, logits)
            for req, token in zip(sample_reqs, tokens, strict=True):
                req.append_token(token)
                req.update_block_hashes(self.cfg.block_size, self.salt)
                reason = self._postprocess(req, token)
                if reason is not None:
                    self._finish(req, reason)
                outputs.append(self._output(req))
        if self.cfg.check_integrity:
            self.check_integrity()
        return outputs

    def _execute(self, batch: ScheduledBatch, all_positions: bool = False) -> ForwardOutput:
        """Run a scheduled batch (`ModelRunner.run`) and account for it: computed counts and
        cached blocks, token eviction."""
        if self.evictor is not None:
            for req in batch.preempted:
                self.evictor.forget(req)
        out = self.runner.run(batch, all_positions)
        if out.score_acc is not None:
            assert self.evictor is not None
            self.evictor.accumulate(batch.requests, out.score_acc, out.seq_lens, batch.num_new_tokens)
        self.scheduler.update_computed(batch)
        if self.evictor is not None:
            self.evictor.after_step(batch.requests)
        return out

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
            group_finished=group_finished, prefilled_tokens=req.num_computed_tokens if req.prefill_only else 0)

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
        ids = [self.add_request(prompt_input(p, sp)) for p, sp in zip(plist, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield one output per new token of this request while stepping the whole engine."""
        rid = self.add_request(prompt_input(prompt, params))
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of every position of `token_ids` (`ModelRunner.logits`)."""
        return self.runner.logits(token_ids)

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
                    if self.store.wait_for_disk(1.0):   # its prefix is being read back from disk
                        continue
                    raise EngineError("score(): the KV pool cannot hold the sequence")
                start = req.num_computed_tokens
                logits = self._execute(batch, all_positions=True).logits   # [n, vocab]
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
                           self.scheduler.num_prefix_waits, self.store.disk_stats(),
                           self.store.pool.protect_window or 0.0, self.scheduler.num_room_waits)

    def check_integrity(self) -> None:
        """The store's invariants, and every device block reference held by a running request."""
        self.store.check_integrity(req.held_block_ids for req in self.scheduler.running)


def _has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


__all__ = ["Engine", "EngineConfig", "EngineError", "EngineStats", "GenerateInput", "InvalidRequest", "Prompt",
           "QueueFull", "RequestOutput", "SamplingParams", "prompt_input"]
