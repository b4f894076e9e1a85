"""Engine behaviour beyond HF equivalence: bad input, abort, streaming, stops, seeds, chunking."""
from __future__ import annotations

import math

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import InvalidRequest, QueueFull, prompt_input
from worker.engine.sampling import SamplingParams, SamplingParamsError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=128,
                               check_integrity=True, max_model_len=64))


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return Engine(EngineConfig(model=str(smollm2_dir), check_integrity=True))


def test_bad_requests_raise_and_engine_keeps_serving(tiny):
    good = [5, 6, 7, 8, 9]
    expected = tiny.generate(good, GREEDY)[0].token_ids
    bad = {
        "empty": ([], GREEDY),
        "out of vocab": ([1, 2, 10_000], GREEDY),
        "negative id": ([-1, 2], GREEDY),
        "too long": (list(range(1, 65)), GREEDY),
    }
    # A long request is running while the bad ones arrive; it must be unaffected.
    rid = tiny.add_request(prompt_input([3] * 10, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    tiny.step()
    for _, (prompt, params) in bad.items():
        with pytest.raises(InvalidRequest):
            tiny.add_request(prompt_input(prompt, params))
    outs = {}
    while tiny.has_unfinished():
        for o in tiny.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[rid].completion_tokens == 20
    assert tiny.generate(good, GREEDY)[0].token_ids == expected
    assert tiny.store.pool.num_used_blocks == 0


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-0.5),
                                    dict(temperature=math.nan), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(SamplingParamsError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_queue_full(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=64, max_queue_len=2))
    e.add_request(prompt_input([1, 2, 3], GREEDY))
    e.add_request(prompt_input([1, 2, 3], GREEDY))
    with pytest.raises(QueueFull):
        e.add_request(prompt_input([1, 2, 3], GREEDY))
    while e.has_unfinished():   # the queued ones drain, then the engine takes more
        e.step()
    assert e.generate([4, 5], GREEDY)[0].completion_tokens == 8


def test_small_pool_caps_max_model_len(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=8))
    assert e.max_model_len == 32                      # what 8 blocks of 4 tokens can hold
    with pytest.raises(InvalidRequest, match="max_model_len"):
        e.add_request(prompt_input([1] * 40, SamplingParams(max_tokens=20)))
    out = e.generate([1] * 20, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert (out.completion_tokens, out.finish_reason) == (12, "length")


def test_abort_frees_blocks(tiny):
    rid = tiny.add_request(prompt_input([9] * 20, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    tiny.step()
    tiny.step()
    assert tiny.store.pool.num_used_blocks > 0
    out = tiny.abort(rid)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert tiny.store.pool.num_used_blocks == 0 and not tiny.has_unfinished()
    assert tiny.abort(rid) is None


def test_chunked_prefill_equals_whole_prefill(tiny_model_dir):
    path = str(tiny_model_dir("llama-gqa"))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(40 + i)] for i in range(4)]
    whole = Engine(EngineConfig(model=path, block_size=4, num_blocks=256)).generate(prompts, GREEDY)
    chunked_engine = Engine(EngineConfig(model=path, block_size=4, num_blocks=256, max_num_batched_tokens=7,
                                         check_integrity=True))
    chunked = chunked_engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_seeded_sampling_is_reproducible(tiny):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=1234, ignore_eos=True)
    a = tiny.generate([4, 5, 6], p)[0].token_ids
    b = tiny.generate([[4, 5, 6], [7, 8, 9, 10]], [p, SamplingParams(max_tokens=5, temperature=0.8)])[0].token_ids
    assert a == b


def test_streaming_deltas_add_up_and_stop_strings(smol):
    prompt = smol.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a cat who learns to fly."}])
    params = SamplingParams(max_tokens=40, temperature=0.0)
    final = smol.generate(prompt, params)[0]
    text, ids = "", []
    for out in smol.stream(prompt, params):
        text += out.new_text
        ids += out.new_token_ids
    assert text == final.text and tuple(ids) == final.token_ids
    # A stop string cuts the text before it and ends the request with "stop".
    word = final.text.split()[4]
    stopped = smol.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=(word,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == final.text[:final.text.index(word)]
    assert smol.store.pool.num_used_blocks == 0


def test_prefix_cache_hit_counts(smol):
    system = [{"role": "system", "content": "You are kvmesh's test assistant. " * 8}]
    a = smol.apply_chat_template(system + [{"role": "user", "content": "Hi"}])
    b = smol.apply_chat_template(system + [{"role": "user", "content": "Hello there"}])
    first = smol.generate(a, GREEDY)[0]
    second = smol.generate(b, GREEDY)[0]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert second.num_cached_tokens == (common // 16) * 16 > 0
    assert first.prompt_tokens == len(a)


def test_priority_admits_a_later_higher_priority_request_first(tiny_model_dir):
    """One sequence slot: while it is busy, an earlier priority-0 request and a later
    priority -5 one wait; the later one is admitted first (lower runs first)."""
    eng = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=64,
                              max_num_seqs=1, check_integrity=True, max_model_len=64))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = eng.add_request(prompt_input([5, 6, 7], params))
    order = [o.request_id for o in eng.step()]            # the batch is full now
    early = eng.add_request(prompt_input([8, 9, 10], params, priority=0))
    late = eng.add_request(prompt_input([11, 12, 13], params, priority=-5))
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id not in order:
                order.append(o.request_id)
            if o.finished:
                final[o.request_id] = o
    assert order == [first, late, early]
    te, tl = final[early].timings, final[late].timings
    assert te.arrival_time < tl.arrival_time and te.first_scheduled_time > tl.first_scheduled_time
    assert te.queue_s > tl.queue_s > 0
    for rid in (-1001, 1001, True, 1.5):
        with pytest.raises(InvalidRequest, match="priority"):
            eng.add_request(prompt_input([5, 6], params, priority=rid))
    assert not eng.has_unfinished() and eng.store.pool.num_used_blocks == 0


def test_outputs_carry_request_timings(tiny):
    outs = list(tiny.stream([21, 22, 23, 24, 25], GREEDY))
    t = outs[-1].timings
    assert outs[-1].finished and outs[0].timings.finished_time is None
    assert t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.last_token_time <= t.finished_time
    assert t.queue_s is not None and t.ttft_s is not None and t.e2e_s is not None
    assert 0 <= t.queue_s <= t.ttft_s <= t.e2e_s
    assert t.prefill_s == pytest.approx(t.ttft_s - t.queue_s) and t.decode_s >= 0
    assert outs[0].timings.first_token_time == t.first_token_time


def test_requests_of_one_new_prefix_arriving_together_compute_it_once(tiny_model_dir):
    """In-flight prefix dedupe: the second request of a prefix the first is computing waits
    one step and reuses it (cached tokens = the prefix's full blocks), while an unrelated
    request behind it is admitted at once; outputs equal those of each prompt alone."""
    def engine(prefix_caching=True):
        return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=128,
                                   check_integrity=True, max_model_len=64, enable_prefix_caching=prefix_caching))
    shared = list(range(30, 50))                     # 5 full blocks
    a, b, other = shared + [7, 8], shared + [9, 10, 11], [60, 61, 62, 63, 64]
    alone = {tuple(p): engine().generate(p, GREEDY)[0].token_ids for p in (a, b, other)}
    eng = engine()
    ids = {eng.add_request(prompt_input(p, GREEDY)): p for p in (a, b, other)}
    first_step = {o.request_id for o in eng.step()}
    assert first_step == {rid for rid, p in ids.items() if p is not b}, "b waits, the unrelated one does not"
    assert eng.stats().num_prefix_waits == 1
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    by_prompt = {tuple(ids[rid]): o for rid, o in final.items()}
    assert by_prompt[tuple(b)].num_cached_tokens == len(shared)
    assert {p: o.token_ids for p, o in by_prompt.items()} == {p: alone[p] for p in by_prompt}
    assert eng.stats().num_prefix_waits == 1 and eng.store.pool.num_used_blocks == 0
    # without a prefix cache nothing would be reused: no request waits
    plain = engine(prefix_caching=False)
    for p in (a, b):
        plain.add_request(prompt_input(p, GREEDY))
    assert len(plain.step()) == 2 and plain.stats().num_prefix_waits == 0


def test_a_prefill_only_request_caches_its_prompt_and_samples_nothing(tiny_model_dir):
    from dataclasses import replace
    e = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=128,
                            max_num_batched_tokens=8, check_integrity=True))   # chunked: 3 prefill steps
    prompt = [(5 * j) % 250 + 3 for j in range(21)]
    rid = e.add_request(replace(prompt_input(prompt, GREEDY, request_id="pre"), prefill_only=True))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    # one output per prefill chunk (its blocks cached), the last one final; no token sampled
    assert [(o.request_id, o.finished, o.token_ids, o.prefilled_tokens) for o in outs] == [
        (rid, False, (), 8), (rid, False, (), 16), (rid, True, (), 21)]
    assert e.store.pool.num_used_blocks == 0
    # the decode side of a hand-off: the whole prompt but its last token is a hit, the tokens are a cold run's
    hit = e.generate(prompt, GREEDY)[0]
    cold = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=128)).generate(
        prompt, GREEDY)[0]
    assert hit.num_cached_tokens == 20 and hit.token_ids == cold.token_ids
