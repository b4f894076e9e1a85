"""Token eviction (StreamingLLM, H2O): the policies keep exactly the tokens they name, the
compaction moves exactly those rows into fresh blocks, and StreamingLLM in the engine equals
HF transformers run with an attention mask that hides exactly the evicted tokens."""
from __future__ import annotations

import random

import pytest
import torch

from kvstore.layout import KVLayout
from kvstore.pool import BlockPool
from kvstore.tensors import KVTensors
from worker.engine.engine import Engine, EngineConfig
from worker.engine.eviction import EvictionConfig, EvictionPolicy, TokenEvictor, select_kept
from worker.engine.request import Request
from worker.engine.sampling import SamplingParams

S, H2O = EvictionPolicy.STREAMING, EvictionPolicy.H2O


def test_select_kept_names_sinks_recent_and_heavy_hitters() -> None:
    assert select_kept(S, 10, 12, 2).tolist() == list(range(10))            # under budget: all
    assert select_kept(S, 20, 8, 2).tolist() == [0, 1, 14, 15, 16, 17, 18, 19]
    scores = torch.zeros(20)
    scores[[5, 9, 3]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0] = 100.0                          # a sink's score does not buy it a second place
    scores[18] = 50.0                          # nor does a recent token's
    # budget 8, sinks 2: recent (8 - 2) // 2 = 3, heavy 3 from positions 2..16
    assert select_kept(H2O, 20, 8, 2, scores).tolist() == [0, 1, 3, 5, 9, 17, 18, 19]
    # no sinks, budget 9: recent 4 (16..19), heavy 5 = the five best of 0..15
    distinct = torch.tensor([float((7 * i) % 20) for i in range(20)])   # a permutation of 0..19
    best = sorted(torch.topk(distinct[:16], 5).indices.tolist())
    assert select_kept(H2O, 20, 9, 0, distinct).tolist() == best + [16, 17, 18, 19]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="kv_budget"):
        EngineConfig(kv_eviction="h2o")
    with pytest.raises(ValueError, match="kv_budget"):
        EngineConfig(kv_eviction="streaming", kv_budget=20, attention_sinks=4, block_size=16)
    with pytest.raises(ValueError, match="kv_eviction"):
        EngineConfig(kv_eviction="lru")
    with pytest.raises(ValueError, match="attention_sinks"):
        EngineConfig(kv_eviction="streaming", kv_budget=64, attention_sinks=-1)
    EngineConfig(kv_eviction="streaming", kv_budget=36, attention_sinks=4, block_size=16)


def test_eviction_refuses_a_sliding_window_model(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="sliding window"):
        Engine(EngineConfig(model=str(tiny_model_dir("mistral-swa")), block_size=4, num_blocks=32,
                            kv_eviction="streaming", kv_budget=12, attention_sinks=2))


@pytest.mark.parametrize("policy", [S, H2O])
def test_compaction_moves_exactly_the_kept_rows_into_fresh_blocks(policy: EvictionPolicy) -> None:
    bs, budget, n = 4, 10, 14                   # 14 >= budget + bs: compact to 10
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=bs, kv_cache_dtype="fp32")
    kv = KVTensors(lay, 12)
    kv.kv.copy_(torch.randn(kv.kv.shape))
    pool = BlockPool(12)
    ev = TokenEvictor(EvictionConfig(policy, budget, 2, bs, h2o_decay=1.0), pool, kv)
    req = Request("r", list(range(n)), SamplingParams(max_tokens=4), n + 4)
    req.block_ids = pool.allocate(4)
    pool.cache_full_blocks(req.block_ids[:2], [11, 22])   # the first two blocks are a shared prefix
    pool.touch(req.block_ids[:1])                          # ... and another request holds block 0
    req.num_computed_tokens = n
    before = kv.kv.clone()
    scores = torch.rand(n)
    reads = n - torch.arange(n, dtype=torch.float32)           # one prefill of n queries: causal
    if policy is H2O:
        ev.accumulate([req], scores[None], [n], [n])
    old_blocks = list(req.block_ids)
    ev.after_step([req])
    kept = select_kept(policy, n, budget, 2, scores / reads if policy is H2O else None)
    old_slots = torch.tensor(old_blocks)[kept // bs] * bs + kept % bs
    new = torch.tensor(req.block_ids)
    new_slots = (new[:, None] * bs + torch.arange(bs)).flatten()[:budget]
    flat_before, flat_after = before.flatten(2, 3), kv.kv.flatten(2, 3)
    assert torch.equal(flat_after[:, :, new_slots], flat_before[:, :, old_slots])
    assert len(req.block_ids) == 3 and req.num_evicted_tokens == n - budget
    assert not set(req.block_ids) & set(old_blocks[:2]), "wrote into a shared/cached block"
    assert torch.equal(kv.kv[:, :, old_blocks[:2]], before[:, :, old_blocks[:2]])
    assert pool.get_cached_block(11) == old_blocks[0] and pool.ref_cnt(old_blocks[0]) == 1
    assert pool.num_used_blocks == 1 + 3
    if policy is H2O:
        assert torch.equal(ev.scores["r"], scores[kept]) and torch.equal(ev.reads["r"], reads[kept])
    pool.check_integrity()


def test_h2o_ranks_by_mean_attention_per_reading_query() -> None:
    """Two tokens with the same summed attention: the one fewer queries read ranks higher."""
    bs, budget = 2, 5
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=bs, kv_cache_dtype="fp32")
    kv = KVTensors(lay, 12)
    pool = BlockPool(12)
    ev = TokenEvictor(EvictionConfig(H2O, budget, 1, bs, h2o_decay=1.0), pool, kv)
    req = Request("r", list(range(9)), SamplingParams(max_tokens=4), 16)
    req.block_ids = pool.allocate(5)
    # step 1: a prefill of 5 tokens (token j read by 5 - j queries); step 2: 4 more tokens
    ev.accumulate([req], torch.tensor([[0.0, 1.0, 1.1, 0.0, 0.0]]), [5], [5])
    ev.accumulate([req], torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), [9], [4])
    assert ev.reads["r"].tolist() == [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert torch.allclose(ev.scores["r"], torch.tensor([0, 2, 1.1, 1, 0, 0, 0, 0, 0]))
    req.num_computed_tokens = 9
    ev.after_step([req])                      # 9 >= 5 + 2: keep sink 0, 2 recent, 2 heavy
    # means: token 1: 2/8, token 2: 1.1/7, token 3: 1/6 -> tokens 1 and 3 (the sums: 1 and 2)
    assert ev.reads["r"].tolist() == [9, 8, 6, 2, 1]
    pool.check_integrity()


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.5])
def test_h2o_decay_counts_a_chunk_like_one_query_per_step(decay: float) -> None:
    """Scores and reads after chunks (the kernel weighs chunk query j by decay ** (q - 1 - j))
    equal those after the same queries one per step, and equal the closed form: token t's
    score is the sum over queries p >= t of decay ** (T - 1 - p) * P[p, t]."""
    n = 11
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, kv_cache_dtype="fp32")
    probs = torch.rand(n, n).tril()
    probs /= probs.sum(-1, keepdim=True)                     # [query p, key t], causal rows
    age = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)  # query p: decay ** (n-1-p)
    want_scores = (age[:, None] * probs.double()).sum(0).float()
    want_reads = age.flip(0).cumsum(0).flip(0).float()       # token t: sum over p >= t
    got = []
    for chunks in ([n], [1] * n, [4, 1, 6]):
        ev = TokenEvictor(EvictionConfig(H2O, 64, 1, 4, h2o_decay=decay), BlockPool(4), KVTensors(lay, 4))
        req = Request("r", list(range(n)), SamplingParams(max_tokens=4), 80)
        end = 0
        for q in chunks:
            end += q
            w = decay ** torch.arange(q - 1, -1, -1, dtype=torch.float32)     # as the kernel weighs
            ev.accumulate([req], (w[:, None] * probs[end - q:end, :end]).sum(0)[None], [end], [q])
        got.append((ev.scores["r"], ev.reads["r"]))
        torch.testing.assert_close(ev.scores["r"], want_scores)
        torch.testing.assert_close(ev.reads["r"], want_reads)
    if decay < 1:   # and decay changes the ranking input: older reads weigh less
        assert not torch.allclose(want_reads, n - torch.arange(n, dtype=torch.float32))


def test_h2o_decay_validated() -> None:
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="h2o_decay"):
            EngineConfig(kv_eviction="h2o", kv_budget=64, h2o_decay=bad)


def _visible_sets(prompt_len: int, num_out: int, budget: int, sinks: int, bs: int) -> list[list[int]]:
    """The cache rows each query position sees under StreamingLLM as the engine runs it: the
    prompt in one prefill, compaction to `budget` whenever the cache reaches budget + bs."""
    vis = [list(range(p + 1)) for p in range(prompt_len)]
    cache = list(range(prompt_len))

    def compact() -> None:
        nonlocal cache
        if len(cache) >= budget + bs:
            cache = cache[:sinks] + cache[len(cache) - (budget - sinks):]
    compact()
    for p in range(prompt_len, prompt_len + num_out - 1):
        cache.append(p)
        vis.append(list(cache))
        compact()
    return vis


def test_streaming_eviction_equals_hf_with_the_evicted_tokens_masked(tiny_model_dir) -> None:
    """A tiny random Llama (GQA): what the engine generates under StreamingLLM equals HF
    transformers run with the attention mask of what each query still saw."""
    from transformers import AutoModelForCausalLM
    model_dir = tiny_model_dir("llama-gqa", initializer_range=0.3)   # sharp enough that the mask shows
    bs, budget, sinks, num_out = 8, 24, 4, 40
    eng = Engine(EngineConfig(model=str(model_dir), block_size=bs, num_blocks=64, check_integrity=True,
                              kv_eviction="streaming", kv_budget=budget, attention_sinks=sinks))
    prompt = [(7 * i + 3) % 250 + 3 for i in range(37)]
    assert len(prompt) >= budget + bs
    out = eng.generate(prompt, SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True))[0]
    ours = list(out.token_ids)
    assert eng.evictor is not None and eng.evictor.num_compactions >= 3
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompt + ours[:-1]
    vis = _visible_sets(len(prompt), num_out, budget, sinks, bs)
    mask = torch.full((len(ids), len(ids)), torch.finfo(torch.float32).min)
    for q, rows in enumerate(vis):
        mask[q, rows] = 0.0
    with torch.inference_mode():
        logits = hf(torch.tensor([ids]), attention_mask=mask[None, None]).logits[0]
    for k, tok in enumerate(ours):
        row = logits[len(prompt) - 1 + k]
        if int(row.argmax()) != tok:
            top = row.topk(2)
            assert float(top.values[0] - top.values[1]) <= 1e-3 and tok in top.indices.tolist(), (
                f"token {k}: kvmesh {tok}, HF with the eviction mask {int(row.argmax())}")
            break
    # and the mask matters: HF without it (full attention) disagrees somewhere
    with torch.inference_mode():
        full = hf(torch.tensor([ids])).logits[0]
    assert any(int(full[len(prompt) - 1 + k].argmax()) != t for k, t in enumerate(ours))


def test_evicting_sequence_stops_caching_blocks(tiny_model_dir) -> None:
    bs, budget = 4, 12
    eng = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=bs, num_blocks=64,
                              check_integrity=True, kv_eviction="h2o", kv_budget=budget, attention_sinks=2))
    rng = random.Random(3)
    prompt = [rng.randrange(3, 200) for _ in range(5)]
    eng.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # blocks are cached until the first compaction at budget + bs = 16 tokens, then never again
    assert eng.store.pool.num_cached_blocks == (budget + bs) // bs
    assert eng.evictor is not None and eng.evictor.num_compactions > 3 and not eng.evictor.scores
    assert eng.store.pool.num_used_blocks == 0


def test_score_in_chunks_equals_one_prefill_and_eviction_changes_it(tiny_model_dir) -> None:
    import torch.nn.functional as F
    d = str(tiny_model_dir("llama-gqa", initializer_range=0.3))   # sharper than uniform logits
    rng = random.Random(4)
    ids = [rng.randrange(3, 250) for _ in range(60)]
    eng = Engine(EngineConfig(model=d, block_size=4, num_blocks=64, check_integrity=True))
    logits = eng.logits(ids)
    want = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    sc = eng.score(ids, 4)
    torch.testing.assert_close(sc.nll, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(sc.argmax, logits[:-1].argmax(-1))
    assert eng.store.pool.num_used_blocks == 0 and not eng.has_unfinished()
    ev = Engine(EngineConfig(model=d, block_size=4, num_blocks=64, check_integrity=True,
                             kv_eviction="streaming", kv_budget=12, attention_sinks=2))
    got = ev.score(ids, 4).nll
    assert got.shape == want.shape
    torch.testing.assert_close(got[:15], want[:15], rtol=1e-4, atol=1e-4)   # before the first eviction
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)
    assert ev.evictor is not None and ev.evictor.num_compactions > 5 and ev.store.pool.num_used_blocks == 0
