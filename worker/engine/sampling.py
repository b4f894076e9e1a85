"""Sampling parameters, batched token sampling, and stop checks.

The order of logit processing follows HF transformers / vLLM:
repetition penalty (prompt + output tokens) → presence/frequency penalties (output tokens)
→ greedy argmax, or temperature → top-k → top-p → min-p → multinomial draw.
Each stage is a public function on a `[B, V]` fp32 tensor so tests can hold it against
the matching HF logits processor; `Sampler` only composes them.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Literal

import torch

from contracts.sampling import SamplingParams, SamplingParamsError  # noqa: F401 (re-exported)


class SamplingHistory:
    """The tokens one request has seen, kept incrementally for the penalties.

    Owned by the engine, one per request; the engine calls `append` after every sampled
    token. Penalties then cost O(distinct tokens) per step, not O(sequence length).
    """

    __slots__ = ("prompt_token_ids", "output_token_ids", "output_counts", "seen_token_ids")

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_counts: dict[int, int] = {}
        self.seen_token_ids: set[int] = set(self.prompt_token_ids)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self.seen_token_ids.add(token_id)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[SamplingHistory]) -> None:
    """In place on `logits` [B, V]: repetition penalty (HF semantics, prompt + output
    tokens: logit > 0 → logit / p, else logit * p), then OpenAI presence/frequency
    penalties over output tokens (logit -= presence * (count > 0) + frequency * count).
    Token ids >= V (embedding larger than lm_head) are ignored, as in HF."""
    vocab_size = logits.shape[1]
    rep_rows: list[int] = []
    rep_cols: list[int] = []
    rep_vals: list[float] = []
    pf_rows: list[int] = []
    pf_cols: list[int] = []
    pf_vals: list[float] = []
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.repetition_penalty != 1.0 and h.seen_token_ids:
            cols = [t for t in h.seen_token_ids if 0 <= t < vocab_size]
            rep_rows += [i] * len(cols)
            rep_cols += cols
            rep_vals += [p.repetition_penalty] * len(cols)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and h.output_counts:
            for t, count in h.output_counts.items():
                if 0 <= t < vocab_size:
                    pf_rows.append(i)
                    pf_cols.append(t)
                    pf_vals.append(p.presence_penalty + p.frequency_penalty * count)
    device = logits.device
    if rep_rows:
        rows = torch.tensor(rep_rows, dtype=torch.long, device=device)
        cols = torch.tensor(rep_cols, dtype=torch.long, device=device)
        pen = torch.tensor(rep_vals, dtype=logits.dtype, device=device)
        picked = logits[rows, cols]
        # ids are unique per row (a set), so the scatter has no write conflicts
        logits[rows, cols] = torch.where(picked > 0, picked / pen, picked * pen)
    if pf_rows:
        rows = torch.tensor(pf_rows, dtype=torch.long, device=device)
        cols = torch.tensor(pf_cols, dtype=torch.long, device=device)
        logits[rows, cols] -= torch.tensor(pf_vals, dtype=logits.dtype, device=device)


def apply_temperature(logits: torch.Tensor, temperatures: Sequence[float]) -> None:
    """In place: row i divided by temperatures[i] (all must be > 0)."""
    t = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    logits.div_(t.unsqueeze(1))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """In place: set filtered logits to -inf. top_k[i] <= 0 disables top-k for row i
    (ties with the k-th value survive, as in HF); top_p[i] == 1 disables top-p. Top-p keeps
    the smallest set of highest-probability tokens (after top-k) whose mass >= top_p, and
    always at least one token — the same ops as HF's TopPLogitsWarper."""
    vocab_size = logits.shape[1]
    k_list = [k if 0 < k < vocab_size else 0 for k in top_k]
    need_k = any(k > 0 for k in k_list)
    need_p = any(p < 1.0 for p in top_p)
    if not need_k and not need_p:
        return
    device = logits.device
    if not need_p:  # top-k only: a partial topk instead of a full sort
        k_eff = [k if k > 0 else 1 for k in k_list]
        k = torch.tensor(k_eff, dtype=torch.long, device=device)
        top_vals = logits.topk(max(k_eff), dim=1).values  # [B, max_k]
        kth = top_vals.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        disabled = torch.tensor([kk == 0 for kk in k_list], device=device).unsqueeze(1)
        kth.masked_fill_(disabled, -math.inf)
        logits.masked_fill_(logits < kth, -math.inf)
        return
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=False)  # [B, V] ascending
    if need_k:
        k = torch.tensor([kk if kk > 0 else vocab_size for kk in k_list], dtype=torch.long, device=device)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    p = torch.tensor(top_p, dtype=logits.dtype, device=device).unsqueeze(1)
    cum = sorted_logits.softmax(dim=1).cumsum(dim=1)  # [B, V]
    remove = cum <= 1 - p
    remove[:, -1] = False
    remove = remove.scatter(1, sorted_idx, remove)
    logits.masked_fill_(remove, -math.inf)


def apply_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> None:
    """In place on probabilities [B, V]: zero tokens with prob < min_p[i] * max prob of the
    row (the max token always survives). Rows need not be renormalised for multinomial."""
    m = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    threshold = probs.amax(dim=1, keepdim=True) * m
    probs.masked_fill_(probs < threshold, 0.0)


class Sampler:
    """Samples one token per row of `logits` [B, V].

    `generators[i]` is row i's own RNG (from `make_generator(params.seed)`); with one the
    draw depends only on that row's logits and generator, never on the rest of the batch.
    Rows with None draw from torch's global RNG. Greedy rows are exactly `argmax` of the
    penalised logits (ties → lowest index). The caller's `logits` are never modified.
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 token_histories: Sequence[SamplingHistory],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        batch = logits.shape[0]
        assert len(params) == len(token_histories) == len(generators) == batch
        if all(p.is_greedy and not p.has_penalties for p in params):
            return logits.argmax(dim=1)  # [B]
        logits = logits.to(torch.float32, copy=True)
        if any(p.has_penalties for p in params):
            apply_penalties(logits, params, token_histories)
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(rand_rows) < batch:
            out = logits.argmax(dim=1)  # [B]
            if not rand_rows:
                return out
            rows_t = torch.tensor(rand_rows, dtype=torch.long, device=logits.device)
            out[rows_t] = self._sample(logits[rows_t], [params[i] for i in rand_rows],
                                       [generators[i] for i in rand_rows])
            return out
        return self._sample(logits, params, generators)

    @staticmethod
    def _sample(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Temperature → top-k → top-p → min-p → draw, on rows that are all non-greedy."""
        apply_temperature(logits, [p.temperature for p in params])
        # Extreme penalties or temperatures overflow fp32 (softmax of +inf is NaN): keep the
        # order, turn +inf into the largest finite value and NaN into "never".
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
        apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        probs = logits.softmax(dim=1)  # [B, V]
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(probs, [p.min_p for p in params])
        out = torch.empty(len(params), dtype=torch.long, device=logits.device)
        global_rows = [i for i, g in enumerate(generators) if g is None]
        if global_rows:
            rows_t = torch.tensor(global_rows, dtype=torch.long, device=logits.device)
            out[rows_t] = torch.multinomial(probs[rows_t], 1).squeeze(1)
        for i, gen in enumerate(generators):
            if gen is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (use the global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _find_stop_span(text: str, new_text_start: int, stops: Sequence[str]) -> tuple[int, int] | None:
    best: tuple[int, int] | None = None
    for s in stops:
        idx = text.find(s, max(0, new_text_start - len(s) + 1))
        if idx >= 0 and (best is None or (idx, idx + len(s)) < best):
            best = (idx, idx + len(s))
    return best


def find_stop(text: str, new_text_start: int, stops: Sequence[str]) -> int | None:
    """Index in `text` where the earliest stop string begins, or None.

    Only matches that end inside the new text `text[new_text_start:]` are considered
    (each stop s is searched from max(0, new_text_start - len(s) + 1)); older matches
    were already reported when their text was new. Ties on the start go to the stop
    that ends first. The engine truncates at the index (or after the stop when
    `include_stop_str_in_output`; see `find_stop_end`).
    """
    span = _find_stop_span(text, new_text_start, stops)
    return None if span is None else span[0]


def find_stop_end(text: str, new_text_start: int, stops: Sequence[str]) -> int | None:
    """Like `find_stop`, but the index just after the same matched stop string."""
    span = _find_stop_span(text, new_text_start, stops)
    return None if span is None else span[1]


def check_stop_token(token_id: int, num_output_tokens: int, params: SamplingParams,
                     eos_token_ids: Collection[int]) -> Literal["stop", "length"] | None:
    """The finish reason after sampling `token_id`, the `num_output_tokens`-th output token.

    "stop" when it is an EOS token (unless `ignore_eos`) or in `stop_token_ids`, once at least
    `min_tokens` tokens are out; otherwise "length" when `num_output_tokens >= max_tokens`;
    otherwise None.
    """
    if num_output_tokens < params.min_tokens:
        return "length" if num_output_tokens >= params.max_tokens else None
    if (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


def suppress_stop_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                         num_output_tokens: Sequence[int], eos_token_ids: Collection[int]) -> torch.Tensor:
    """`logits` [B, V] with EOS (unless `ignore_eos`) and `stop_token_ids` set to -inf on rows
    that have fewer than `min_tokens` output tokens (vLLM's min_tokens). Returns the input
    itself when no row needs it, else a masked copy: the caller's tensor is never modified."""
    rows = [i for i, (p, n) in enumerate(zip(params, num_output_tokens)) if n < p.min_tokens]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        banned = set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else set(eos_token_ids))
        ids = [t for t in banned if t < out.shape[1]]
        if ids:
            out[i, torch.tensor(ids, dtype=torch.long, device=out.device)] = float("-inf")
    return out
