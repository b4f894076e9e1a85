"""n / best_of in the engine: sequences forked after one prefill share the prompt's
blocks through the pool's reference counts; the partial last block is copied on first write;
nothing leaks. Each sequence i samples like a request seeded seed + i. Also prompt logprobs
with max_tokens 0, and the raw logprobs against the model's own log_softmax."""
from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import RequestOutput, prompt_input
from worker.engine.sampling import SamplingParams

BS = 4
PROMPT = [5, 17, 42, 99, 3, 250, 7, 81, 64, 12]   # 10 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=BS, num_blocks=64,
                               check_integrity=True))


def run(e: Engine, prompt: list[int], params: SamplingParams) -> dict[int, list[RequestOutput]]:
    e.add_request(prompt_input(prompt, params))
    by_index: dict[int, list[RequestOutput]] = {}
    while e.has_unfinished():
        for out in e.step():
            by_index.setdefault(out.index, []).append(out)
    return by_index


def test_fork_shares_blocks_copies_partial_block_and_frees_all(tiny: Engine) -> None:
    free = tiny.store.num_free_blocks
    rid = tiny.add_request(prompt_input(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)))
    tiny.step()                                   # prefill, fork, first tokens
    seqs = sorted((r for r in tiny.requests.values() if r.group_id == rid), key=lambda r: r.index)
    assert [r.index for r in seqs] == [0, 1, 2]
    full, partial = seqs[0].block_ids[:2], seqs[0].block_ids[2]
    for r in seqs:                                # every sequence holds the same full blocks
        assert r.block_ids[:2] == full
    assert [tiny.store.pool.ref_cnt(b) for b in full] == [3, 3]
    assert tiny.store.pool.ref_cnt(partial) == 3  # shared until written
    assert tiny.store.num_free_blocks == free - 3
    tiny.step()                                   # each sequence writes its token 10 into block 2
    tails = [r.block_ids[2] for r in seqs]
    assert len(set(tails)) == 3 and partial in tails   # two copies; the last writer kept the original
    assert all(tiny.store.pool.ref_cnt(b) == 1 for b in tails)
    assert [tiny.store.pool.ref_cnt(b) for b in full] == [3, 3]
    while tiny.has_unfinished():
        tiny.step()
    assert tiny.store.num_free_blocks == free and tiny.store.pool.num_used_blocks == 0


def test_sequences_sample_like_requests_seeded_seed_plus_i(tiny: Engine) -> None:
    got = run(tiny, PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=21, n=3))
    assert sorted(got) == [0, 1, 2]
    assert [o.group_finished for o in got[0] + got[1] + got[2]].count(True) == 1
    for i in range(3):
        alone = tiny.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=21 + i))[0]
        assert got[i][-1].token_ids == alone.token_ids
    assert len({got[i][-1].token_ids for i in range(3)}) == 3


def test_best_of_samples_best_of_sequences_with_cumulative_logprob(tiny: Engine) -> None:
    got = run(tiny, PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=4, n=1, best_of=3))
    assert sorted(got) == [0, 1, 2]
    for outs in got.values():
        final = outs[-1]
        lps = [lp for o in outs for lp in o.new_logprobs]
        assert final.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps))
        assert [lp.token_id for lp in lps] == list(final.token_ids)


def test_logprobs_are_the_raw_log_softmax(tiny: Engine) -> None:
    outs = run(tiny, PROMPT, SamplingParams(max_tokens=4, temperature=0.7, seed=1, logprobs=2, prompt_logprobs=1,
                                            repetition_penalty=1.3))[0]
    ids = PROMPT + list(outs[-1].token_ids)
    want = torch.log_softmax(tiny.logits(ids), dim=-1)
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(PROMPT) - 1
    lps = list(prompt_lps) + [lp for o in outs for lp in o.new_logprobs]
    got = torch.tensor([lp.logprob for lp in lps])
    torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)
    for pos, lp in enumerate(lps):
        k = 1 if pos < len(PROMPT) - 1 else 2
        assert [t for t, _ in lp.top] == want[pos].topk(k).indices.tolist()


def test_max_tokens_zero_returns_prompt_logprobs_only(tiny: Engine) -> None:
    free = tiny.store.num_free_blocks
    tiny.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))   # cached now
    outs = run(tiny, PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert len(outs) == 1 and outs[0].token_ids == () and outs[0].finish_reason == "length"
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(PROMPT) - 1
    assert outs[0].num_cached_tokens == 0          # the cache hit was bypassed for the logits
    assert tiny.store.pool.num_used_blocks == 0 and tiny.store.num_free_blocks == free
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
