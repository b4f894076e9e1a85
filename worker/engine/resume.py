"""A migrated request's continuation: the new worker takes the
tokens the dead one already streamed as its own output."""
from __future__ import annotations

import torch

from contracts.tokenizer import ModelTokenizer
from worker.engine.request import Request


def resume(req: Request, resumed: list[int], tokenizer: ModelTokenizer | None, vocab_size: int,
           device: torch.device) -> None:
    """Make `req` look as if it had generated `resumed` and reported them: output tokens
    (penalties, min/max_tokens, usage), the text already sent (stop strings that span the
    seam are still found), and a seeded generator advanced by one draw per token (each
    draw of `Sampler` consumes the same random numbers whatever the logits: one
    exponential per vocabulary entry), so seeded sampling continues as it would have."""
    assert req.history is not None
    for t in resumed:
        req.output_token_ids.append(t)
        req.all_token_ids.append(t)
        req.history.append(t)
    req.sent_tokens = len(resumed)
    if tokenizer is not None:
        req.output_text = tokenizer.decode(resumed, skip_special_tokens=req.params.skip_special_tokens)
        req.sent_text = len(req.output_text.rstrip("\ufffd"))
    if req.generator is not None and not req.params.is_greedy:
        scratch = torch.empty(vocab_size, dtype=torch.float32, device=device)
        for _ in resumed:
            scratch.exponential_(1, generator=req.generator)
