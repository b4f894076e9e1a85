"""Greedy tokens of the engine equal HF transformers, on every cache path
(docs/ARCHITECTURE.md, "The correctness bar")."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.oracle import assert_greedy_match, hf_greedy, hf_logits_fn
from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import prompt_input
from worker.engine.sampling import SamplingParams

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What does a KV cache store in a transformer?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(smollm2_dir)))
    prompts = [engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": q}]) for q in QUESTIONS]
    eos = list(engine.model_config.eos_token_ids)
    expected = [hf_greedy(hf, p, NEW_TOKENS, eos) for p in prompts]
    return hf, prompts, expected


def _check(engine: Engine, hf, prompts, expected, outs) -> None:
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_match(o.token_ids, e, p, engine.logits, hf_logits_fn(hf))
    assert engine.store.pool.num_used_blocks == 0, "blocks still referenced after every request finished"
    engine.store.pool.check_integrity()


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("mode", ["one_at_a_time", "batch", "batch_no_prefix_cache", "preemption"])
def test_smollm2_matches_hf(smol, smollm2_dir, mode):
    hf, prompts, expected = smol
    # fp32 weights: greedy exactness vs HF's fp32 forward is the bar for fp32 (and bf16) weights; the
    # Q8_0 / Q4 kernels of the default (auto: the GGUF's Q4_1) take int8 inputs, and are held to HF
    # with the same input quantization (test_weight_formats_model.py, tests/support/act_quant.py)
    cfg = dict(model=str(smollm2_dir), check_integrity=True, weight_dtype="fp32")
    if mode == "batch_no_prefix_cache":
        cfg["enable_prefix_caching"] = False
    if mode == "preemption":
        cfg["num_blocks"] = 12
    engine = Engine(EngineConfig(**cfg))
    if mode == "one_at_a_time":
        outs = [engine.generate(p, GREEDY)[0] for p in prompts]
        # The shared system prompt is served from the prefix cache after the first request.
        assert all(o.num_cached_tokens > 0 for o in outs[1:])
        assert outs[0].num_cached_tokens == 0
    else:
        outs = engine.generate(prompts, GREEDY)
    if mode == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if mode == "batch_no_prefix_cache":
        assert all(o.num_cached_tokens == 0 for o in outs)
    _check(engine, hf, prompts, expected, outs)


TINY_KINDS = ["llama-mha", "llama-gqa", "llama-mqa", "llama3-rope", "mistral-swa", "qwen2-bias"]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_models_match_hf(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(kind)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(20)]     # a shared prefix longer than a block
    prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, 24, [], ignore_eos=True) for p in prompts]
    for cfg in (dict(num_blocks=256), dict(num_blocks=24, max_num_batched_tokens=32),
                dict(num_blocks=256, enable_prefix_caching=False)):
        engine = Engine(EngineConfig(model=str(path), block_size=4, check_integrity=True, **cfg))
        outs = engine.generate(prompts, params)
        _check(engine, hf, prompts, expected, outs)
        single = [engine.generate(p, params)[0] for p in prompts]
        _check(engine, hf, prompts, expected, single)


def test_sliding_window_releases_blocks_and_matches_hf(tiny_model_dir):
    """Mistral with window 8, block size 4: during a long generation each sequence holds at
    most 8/4 + 1 = 3 blocks, blocks behind the window go back to the pool, and the tokens
    equal HF's."""
    path = tiny_model_dir("mistral-swa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    window, bs = hf.config.sliding_window, 4
    assert window == 8
    rng = random.Random("swa-release")
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (5, 13)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, 60, [], ignore_eos=True) for p in prompts]
    engine = Engine(EngineConfig(model=str(path), block_size=bs, num_blocks=64, check_integrity=True))
    ids = [engine.add_request(prompt_input(p, params)) for p in prompts]
    outs: dict[str, object] = {}
    max_held = 0
    while engine.has_unfinished():
        for req in engine.scheduler.running:
            if req.num_computed_tokens >= req.num_prompt_tokens:   # generating
                max_held = max(max_held, len(req.held_block_ids))
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert max_held == window // bs + 1
    _check(engine, hf, prompts, expected, [outs[i] for i in ids])
    assert engine.store.pool.num_used_blocks == 0
