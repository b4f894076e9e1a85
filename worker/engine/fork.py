"""n / best_of: a request's sequences forked after its prefill.

The request itself is sequence 0; when its prompt is computed and it is about to sample its
first token, `fork_sequences` adds sequences 1..best_of-1 that share its blocks
(`Scheduler.fork`: one more reference each, the partial last block copied on first write)
and sample their first token from the same logits row, each with its own generator
(seed + i when a seed is given).
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch

from worker.engine.request import Request
from worker.engine.sampling import make_generator
from worker.engine.scheduler import Scheduler


def fork_sequences(reqs: list[Request], logits: torch.Tensor, scheduler: Scheduler,
                   requests: MutableMapping[str, Request], device: torch.device) -> tuple[list[Request], torch.Tensor]:
    """`reqs` (the rows of `logits` [B, V] about to be sampled) with the new sequences of the
    not-yet-forked ones after their parent, and their rows (copies of the parent's)."""
    if all(r.forked for r in reqs):
        return reqs, logits
    out: list[Request] = []
    rows: list[int] = []
    for i, req in enumerate(reqs):
        out.append(req)
        rows.append(i)
        if req.forked:
            continue
        children = [_sequence(req, k, device) for k in range(1, req.params.num_sequences)]
        scheduler.fork(req, children)
        for child in children:
            requests[child.request_id] = child
        out += children
        rows += [i] * len(children)
    return out, logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]


def _sequence(parent: Request, index: int, device: torch.device) -> Request:
    seed = parent.params.seed
    child = Request(f"{parent.request_id}#{index}", list(parent.prompt_token_ids), parent.params,
                    parent.max_total_tokens, make_generator(None if seed is None else seed + index, device),
                    parent.priority, parent.hash_root, arrival_time=parent.arrival_time, group_id=parent.group_id,
                    index=index, forked=True)
    child.prompt_logprobs = parent.prompt_logprobs   # reported once, by sequence 0
    child.sent_prompt_logprobs = True
    return child
