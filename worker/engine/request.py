"""One request's state inside a worker, what the engine hands back for it, and `prompt_input`,
the request spec (contracts `GenerateInput`) of a text or token-id prompt."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from contracts.requests import NO_TENANT, GenerateInput, TenantShare
from kvstore.keys import BlockHash, extend_block_hashes
from kvstore.pool import BlockId
from worker.engine.sampling import SamplingHistory, SamplingParams


class TokenLogprob(NamedTuple):
    """`token_id`'s log-probability at one position, and the `top` (token id, logprob) pairs
    there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class EngineError(Exception):
    """Base of the errors a caller of the engine must handle."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is bad (empty prompt, too long, bad token ids); nothing was queued."""


class QueueFull(EngineError):
    """The waiting queue is at its limit; try later (gRPC RESOURCE_EXHAUSTED)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


Prompt = str | Sequence[int]


def prompt_input(prompt: Prompt, params: SamplingParams, request_id: str = "", *, priority: int = 0,
                 cache_salt: str = "", max_tokens_given: bool = False, resume_tokens: int = 0) -> GenerateInput:
    """The request spec `Engine.add_request` takes, for a text (`str`) or token-id prompt
    (benches, tests and the engine's own conveniences; the gRPC front gets one from the wire).
    `max_tokens_given` defaults to False here: a prompt plus `max_tokens` past max_model_len
    is generated up to max_model_len instead of rejected."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(int(t) for t in prompt))
    return GenerateInput(request_id, text, ids, None, params, priority=priority, cache_salt=cache_salt,
                         max_tokens_given=max_tokens_given, resume_tokens=resume_tokens)


MIN_PRIORITY, MAX_PRIORITY = -1000, 1000   # the accepted `priority` range (lower runs first)

NO_BLOCK = BlockId(-1)   # a block_ids entry whose block was released (outside the window)


@dataclass(eq=False)
class Request:
    """Mutable per-request state, owned by the scheduler.

    `block_ids` hold one reference each (taken by allocate or touch) until the request is
    preempted or finished, except entries `NO_BLOCK`: blocks released early because no
    future token can attend to them (wholly outside a sliding window); `block_hashes`
    cover every full block of `all_token_ids`.
    `num_computed_tokens` counts the tokens whose K/V are in the cache.
    `priority`: lower is admitted first (ties in arrival order). `hash_root` is the virtual
    parent of the first block (`kvstore.keys.cache_salt_root` of the request's cache_salt;
    None: unsalted). The `*_time` fields are
    `time.monotonic()` readings (see `RequestTimings`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int
    generator: torch.Generator | None = None
    priority: int = 0
    hash_root: BlockHash | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_evicted_tokens: int = 0      # of the computed ones, dropped by token eviction (worker.engine.eviction)
    num_cached_tokens: int = -1      # set at first admission: prompt tokens found in the cache
    num_preemptions: int = 0
    num_room_waits: int = 0          # steps its admission was put off to keep a shared prefix (scheduler)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    history: SamplingHistory | None = None
    output_text: str = ""
    sent_tokens: int = 0             # how many output tokens / chars were already reported
    sent_text: int = 0
    first_scheduled_time: float | None = None   # first admission (set by the scheduler)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None          # set by the scheduler's finish
    # n / best_of: sequence `index` of the client's request `group_id`
    group_id: str = ""                          # "" until __post_init__: request_id
    index: int = 0
    forked: bool = False                        # its siblings exist (or it needs none)
    logprobs: list[TokenLogprob] = field(default_factory=list)          # one per output token
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # prompt tokens 1..
    cumulative_logprob: float = 0.0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    tenant: TenantShare = NO_TENANT             # who sent it: fair share and cache cap (worker.engine.fairness)
    prefill_only: bool = False                  # finishes once its prompt is computed, sampling nothing
    shared_prefix_blocks: int = 0               # leading blocks the router expects shared (protected at once)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.history = SamplingHistory(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        self.forked = self.forked or self.params.num_sequences == 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (then no prefix-cache hit)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def held_block_ids(self) -> list[BlockId]:
        """The blocks this request holds a reference to, in sequence order."""
        return [b for b in self.block_ids if b != NO_BLOCK]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def update_block_hashes(self, block_size: int, salt: bytes) -> None:
        self.block_hashes = extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, salt,
                                                self.hash_root)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        assert self.history is not None
        self.history.append(token_id)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def timings(self) -> RequestTimings:
        return RequestTimings(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time)


class RequestTimings(NamedTuple):
    """When one request passed each point, as `time.monotonic()` seconds (None: not yet),
    so that a metrics layer computes latencies without engine internals. Queue time counts
    from arrival to first admission; prefill from there to the first token (a preempted
    request's recompute lands in decode)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None

    @property
    def queue_s(self) -> float | None:
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return _since(self.arrival_time, self.first_token_time)

    @property
    def prefill_s(self) -> float | None:
        return _since(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_s(self) -> float | None:
        """First token to last token."""
        return _since(self.first_token_time, self.last_token_time)

    @property
    def e2e_s(self) -> float | None:
        """Arrival to finish."""
        return _since(self.arrival_time, self.finished_time)


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A snapshot of one request after an engine step; `new_*` are the deltas since the last one."""

    request_id: str
    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int
    timings: RequestTimings
    index: int = 0                              # the sequence (n / best_of); request_id is the group's
    new_logprobs: tuple[TokenLogprob, ...] = ()  # one per new_token_ids entry, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None   # in the group's first output only
    cumulative_logprob: float | None = None
    group_finished: bool = True                 # every sequence of the request finished
    prefilled_tokens: int = 0                   # a prefill-only request: prompt tokens computed so far
