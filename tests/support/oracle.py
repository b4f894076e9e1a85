"""HF transformers as the oracle for greedy decoding, with the near-tie rule of docs/ARCHITECTURE.md.

Two greedy runs may part only where fp32 rounding decides a near-tie: at the first
divergence, the top-2 logits of BOTH models must lie within `tol` and be exactly the two
tokens the runs chose. Anything else fails — nothing is skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LogitsFn = Callable[[Sequence[int]], torch.Tensor]   # token ids -> [T, vocab] logits


def hf_logits_fn(hf_model) -> LogitsFn:
    def fn(ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_model(torch.tensor([list(ids)])).logits[0].float()
    return fn


def hf_greedy(hf_model, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
              ignore_eos: bool = False) -> list[int]:
    """HF `generate` greedy continuation; with ignore_eos it always runs max_new_tokens."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([list(prompt)]),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                min_new_tokens=max_new_tokens if ignore_eos else None,
                                eos_token_id=list(eos_ids) or None, pad_token_id=(list(eos_ids) or [0])[0])
    return out[0, len(prompt):].tolist()


def assert_greedy_match(ours: Sequence[int], theirs: Sequence[int], prompt: Sequence[int],
                        our_logits: LogitsFn, their_logits: LogitsFn, tol: float = 1e-3) -> None:
    ours, theirs = list(ours), list(theirs)
    if ours == theirs:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert i is not None, f"one run is a strict prefix of the other: {len(ours)} vs {len(theirs)} tokens"
    ctx = list(prompt) + ours[:i]
    for name, fn in (("kvmesh", our_logits), ("hf", their_logits)):
        last = fn(ctx)[-1]
        top = last.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap <= tol and set(top.indices.tolist()) == {ours[i], theirs[i]}, (
            f"divergence at new token {i} is not a near-tie on the {name} side: top-2 "
            f"{top.indices.tolist()} gap {gap:.2e} (kvmesh chose {ours[i]}, hf chose {theirs[i]})")


def assert_outcomes_equal_or_near_tie(outcomes: Sequence, baseline: dict, prompts: Sequence[str],
                                      model_dir) -> None:
    """Chaos runs' streams (`kvmesh.bench.chaos_harness.Outcome`) against the same run's fault-free
    `baseline` (prompt index -> Outcome): tokens equal, and so the streamed text (joined across the
    seam of a migrated stream); or the first divergence is a near-tie under HF transformers."""
    for o in outcomes:
        if o.tokens == baseline[o.prompt].tokens:
            assert o.text == baseline[o.prompt].text, (o, baseline[o.prompt])
    differing = [o for o in outcomes if o.tokens != baseline[o.prompt].tokens]
    if not differing:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for o in differing:
        ids = tok(prompts[o.prompt])["input_ids"]
        assert_greedy_match(o.tokens, baseline[o.prompt].tokens, ids, hf_logits_fn(hf), hf_logits_fn(hf))
