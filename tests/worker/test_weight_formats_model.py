"""The default model in its own format (the shipped GGUF's Q4_1 layers and Q8_0 embedding) and in
each `weight_dtype`: the GGUF's blocks dequantize to exactly what transformers made of them, and
greedy decoding equals HF transformers run on the very weight values the engine holds (for Q8_0 /
Q4_* weights with its inputs quantized to int8 as the kernel quantizes them: tests/support/act_quant.py)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.act_quant import int8_activations
from tests.support.oracle import assert_greedy_match, hf_greedy, hf_logits_fn
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams
from worker.kernels import native
from worker.model.loader import load_weights
from worker.model.weights import dense

pytestmark = [pytest.mark.skipif(not native.qlinear_isa(), reason="the native kernels are not built here"),
              pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16


def test_gguf_blocks_dequantize_to_transformers_conversion(smollm2_dir) -> None:
    """`auto` reads the GGUF's own tensors (q/k rows put back in HF order): each one, dequantized,
    equals the fp32 dir transformers converted from the same file, bit for bit."""
    fp32 = load_weights(smollm2_dir)
    own = load_weights(smollm2_dir, weight_dtype="auto")
    assert own.weight_format == "q4_1 (210), q8_0 (1)"
    assert own.weight_bytes < fp32.weight_bytes / 5
    assert set(own.weights) == set(fp32.weights)
    for name, t in fp32.weights.items():
        assert torch.equal(dense(own.weights[name]), t), name


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16", "auto", "q8_0"])
def test_greedy_tokens_match_hf_on_the_same_weight_values(smollm2_dir, weight_dtype: str) -> None:
    loaded = load_weights(smollm2_dir, weight_dtype=weight_dtype)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    state = {name: dense(w) for name, w in loaded.weights.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    engine = Engine(EngineConfig(model=str(smollm2_dir), weight_dtype=weight_dtype, num_blocks=64))
    assert engine.runner.weight_format == loaded.weight_format
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    eos = list(engine.model_config.eos_token_ids)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, params)
    quantized = weight_dtype in ("auto", "q8_0")     # every linear (LM head too) runs on int8 inputs
    with int8_activations(hf) if quantized else contextlib.nullcontext():
        for prompt, out in zip(prompts, outs, strict=True):
            assert_greedy_match(out.token_ids, hf_greedy(hf, prompt, NEW_TOKENS, eos), prompt, engine.logits,
                                hf_logits_fn(hf))
