"""The per-step prefill cap (`step_prefill_tokens`, a decode-role worker's): a step decodes every
running request and computes at most that many prompt tokens beside, so no decode waits behind a
long chunk. The scheduler driven step by step without a model (every scheduled token counts as
computed); the engine's greedy tokens against whole prefills (the oracle)."""
from __future__ import annotations

import itertools

import pytest

from kvstore.layout import KVLayout
from kvstore.store import KVStore
from tests.support.scheduling import step_scheduler
from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import Request
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, kv_cache_dtype="fp32")
SALT = b"step-prefill-test"
_tokens = itertools.count(1000)


def _scheduler(step_prefill_tokens: int, chunked: bool = True) -> Scheduler:
    cfg = SchedulerConfig(block_size=BS, max_num_seqs=64, max_num_batched_tokens=1024, enable_chunked_prefill=chunked,
                          step_prefill_tokens=step_prefill_tokens)
    return Scheduler(cfg, KVStore(LAYOUT, 1024, "cpu"), SALT)


def _request(rid: str, prompt_tokens: int, max_tokens: int) -> Request:
    prompt = [next(_tokens) for _ in range(prompt_tokens)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), prompt_tokens + max_tokens)


def _step(s: Scheduler) -> ScheduledBatch:
    return step_scheduler(s, BS, SALT)


def _decoding(s: Scheduler, n: int) -> list[Request]:
    """`n` requests past their prefill, decoding."""
    reqs = [_request(f"d{i}", 8, 100) for i in range(n)]
    for r in reqs:
        s.add(r)
    while any(not r.output_token_ids for r in reqs):
        _step(s)
    return reqs


def test_a_short_prompt_is_computed_a_few_tokens_per_step_beside_every_decode() -> None:
    s = _scheduler(step_prefill_tokens=4)
    decoding = _decoding(s, 2)
    new = _request("new", 24, 4)
    s.add(new)
    steps = []
    while not new.output_token_ids:
        batch = _step(s)
        steps.append(dict(zip((r.request_id for r in batch.requests), batch.num_new_tokens, strict=True)))
    assert len(steps) == 6                                # 24 prompt tokens, 4 a step
    for step in steps:
        assert all(step[r.request_id] == 1 for r in decoding)   # no decode skipped a step
        assert step["new"] == 4


def test_the_cap_spans_every_prefilling_request_of_a_step() -> None:
    s = _scheduler(step_prefill_tokens=4)
    _decoding(s, 1)
    new = [_request(rid, 10, 2) for rid in ("a", "b")]
    for r in new:
        s.add(r)
    steps = 0
    while any(not r.output_token_ids for r in new):
        prefilling = {r.request_id for r in new if not r.output_token_ids}
        batch = _step(s)
        steps += 1
        assert sum(n for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
                   if r.request_id in prefilling) <= 4
        assert "d0" in {r.request_id for r in batch.requests}
    assert steps == 5                                      # 20 prompt tokens, 4 a step


def test_without_a_cap_or_without_chunking_a_prompt_is_computed_in_one_step() -> None:
    for s in (_scheduler(step_prefill_tokens=0), _scheduler(step_prefill_tokens=4, chunked=False)):
        _decoding(s, 2)
        new = _request("new", 24, 4)
        s.add(new)
        batch = _step(s)
        assert dict(zip((r.request_id for r in batch.requests), batch.num_new_tokens, strict=True))["new"] == 24


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="step_prefill_tokens"):
        SchedulerConfig(step_prefill_tokens=-1)
    with pytest.raises(ValueError, match="step_prefill_tokens"):
        EngineConfig(step_prefill_tokens=-1)


def test_capped_prefill_gives_the_tokens_of_whole_prefills(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama-gqa"))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(11 * i + j) % 250 + 3 for j in range(30 + 5 * i)] for i in range(3)]
    whole = Engine(EngineConfig(model=path, block_size=4, num_blocks=256)).generate(prompts, greedy)
    capped = Engine(EngineConfig(model=path, block_size=4, num_blocks=256, step_prefill_tokens=3,
                                 check_integrity=True)).generate(prompts, greedy)
    assert [o.token_ids for o in capped] == [o.token_ids for o in whole]


def test_a_decode_worker_caps_its_steps_prefill_and_a_mixed_one_does_not() -> None:
    from worker.server.cli import DECODE_STEP_PREFILL_TOKENS, role_engine_config
    base = EngineConfig(max_num_batched_tokens=2048)
    assert role_engine_config(base, "decode", 256).step_prefill_tokens == DECODE_STEP_PREFILL_TOKENS > 0
    assert role_engine_config(base, "decode", 256, 24).step_prefill_tokens == 24   # --decode-step-prefill-tokens
    assert role_engine_config(base, "decode", 256, 0).step_prefill_tokens == 0     # 0: no cap
    assert role_engine_config(base, "mixed", 256, 24) == base
    prefill = role_engine_config(base, "prefill", 256, 24)
    assert (prefill.max_num_batched_tokens, prefill.step_prefill_tokens) == (256, 0)


# A prompt that skips the prefill hop is computed by its decode worker at the worker's budget
# beside every decode there. With both defaults, one just under the router's threshold reaches its
# first token within this many steps of a busy decode worker: ~1.5 s at the 35-55 ms such a step
# lasts beside two streams on a CPU core (kvmesh bench disagg: decode_step_budget), about the hop's
# TTFT there (skip_crossover). Raising the threshold without the budget, or lowering the budget,
# fails here instead of in a user's TTFT.
MAX_SKIPPED_PROMPT_STEPS = 32


def test_a_prompt_just_under_the_skip_threshold_gets_its_first_token_in_bounded_steps_of_a_busy_decode_worker() \
        -> None:
    from router.config import RouterConfig
    from worker.server.cli import role_engine_config
    threshold = RouterConfig().disagg_min_prompt_tokens
    cfg = role_engine_config(EngineConfig(max_num_batched_tokens=1024), "decode", 256)
    budget = cfg.step_prefill_tokens
    s = _scheduler(step_prefill_tokens=budget)
    decoding = _decoding(s, 4)                 # a busy decode worker: four streams
    skipped = _request("skipped", threshold - 1, 4)
    s.add(skipped)
    steps = 0
    while not skipped.output_token_ids:
        batch = _step(s)
        steps += 1
        assert {r.request_id for r in decoding} <= {r.request_id for r in batch.requests}   # no decode waits
        assert steps <= MAX_SKIPPED_PROMPT_STEPS, f"{threshold - 1} tokens at {budget} a step: past the bound"
    assert steps == -(-(threshold - 1) // budget)
