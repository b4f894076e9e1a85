"""Log-probabilities of chosen tokens and their top alternatives.

Computed from the engine's fp32 logits as the model produced them (vLLM's default
`logprobs_mode=raw_logprobs`: before min_tokens suppression, penalties, temperature and the
top-k/top-p/min-p filters), and only for the rows of requests that ask: a batch where no
request wants them pays nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from worker.engine.request import Request, TokenLogprob


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """Row i of `logits` [R, V]: the logprob of `targets[i]` and the `num_top[i]` most likely tokens."""
    rows = logits.shape[0]
    assert len(targets) == len(num_top) == rows, (rows, len(targets), len(num_top))
    if rows == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)                      # [R, V]
    target_t = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, target_t.unsqueeze(1)).squeeze(1).tolist()   # [R]
    k = max(num_top)
    top_vals: list[list[float]] = [[] for _ in range(rows)]
    top_ids: list[list[int]] = [[] for _ in range(rows)]
    if k > 0:
        top = lp.topk(k, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprob(int(t), float(c), tuple(zip(ids[:n], vals[:n])))
            for t, c, ids, vals, n in zip(targets, chosen, top_ids, top_vals, num_top)]


class PromptSpan(NamedTuple):
    """Prompt positions [first, first + count) of `req` computed in one forward pass, whose
    logits are rows [row, row + count) of the pass's logits; position p predicts token p + 1."""

    req: Request
    first: int
    count: int
    row: int
    token_rows: range      # the same positions as rows of the flat batch of new tokens


def prompt_span(req: Request, start: int, n: int, base: int, row: int) -> PromptSpan | None:
    """The positions of `req`'s chunk [start, start + n) (flat rows from `base`) whose prompt
    logprobs are still missing; None when there are none."""
    lo = max(start, len(req.prompt_logprobs))
    hi = min(start + n, req.num_prompt_tokens - 1)
    if hi <= lo:
        return None
    return PromptSpan(req, lo, hi - lo, row, range(base + lo - start, base + hi - start))


def record_prompt_logprobs(spans: Sequence[PromptSpan], logits: torch.Tensor) -> None:
    for span in spans:
        req = span.req
        assert span.first == len(req.prompt_logprobs), "prompt logprobs are computed in order"
        targets = req.prompt_token_ids[span.first + 1:span.first + 1 + span.count]
        k = req.params.prompt_logprobs or 0
        req.prompt_logprobs.extend(token_logprobs(logits[span.row:span.row + span.count], targets,
                                                  [k] * span.count))


def record_sampled_logprobs(reqs: Sequence[Request], logits: torch.Tensor, tokens: Sequence[int]) -> None:
    """Append each sampled token's logprob (row i of `logits` [B, V] sampled `tokens[i]`) to
    the requests that want them; the others cost nothing."""
    rows = [i for i, r in enumerate(reqs) if r.params.wants_logprobs]
    if not rows:
        return
    sub = logits if len(rows) == len(reqs) else logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    chosen = token_logprobs(sub, [tokens[i] for i in rows], [reqs[i].params.logprobs or 0 for i in rows])
    for i, lp in zip(rows, chosen):
        reqs[i].logprobs.append(lp)
        reqs[i].cumulative_logprob += lp.logprob


def take_unsent_logprobs(req: Request) -> tuple[tuple[TokenLogprob, ...], tuple[TokenLogprob, ...] | None]:
    """The output-token logprobs not reported yet, and the prompt's once it is complete."""
    new = tuple(req.logprobs[req.sent_logprobs:])
    req.sent_logprobs = len(req.logprobs)
    prompt = None
    if req.params.prompt_logprobs is not None and not req.sent_prompt_logprobs and not req.needs_prompt_logits:
        prompt = tuple(req.prompt_logprobs)
        req.sent_prompt_logprobs = True
    return new, prompt
