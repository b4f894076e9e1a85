"""What router and worker both speak, as plain frozen dataclasses: a validated generate
request, its peer hints and chat messages, a peer's block-send request, and `BadRequest`.

Built at the protobuf edge (contracts/wire.py) and never holding a protobuf message;
torch-free and gRPC-free, so every layer may import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from contracts.sampling import SamplingParams


class BadRequest(ValueError):
    """The request cannot be served as sent; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PeerHint:
    """A peer that holds the first `num_blocks` blocks of the prompt (router -> worker).
    `handoff`: the peer prefilled the prompt for this request (disaggregated serving): fetch
    without weighing recompute, and give up after `timeout_s` (> 0)."""

    worker_id: str
    address: str
    num_blocks: int
    handoff: bool = False
    timeout_s: float = 0.0


# A tenant counts as busy from a request's arrival until this long after its last one ended,
# on the router (which tenants share the cluster) and on each worker (which share its steps).
TENANT_BUSY_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class TenantShare:
    """The tenant that sent a request and its share of a worker (router -> worker, from the
    keys file): `weight` of the compute relative to other tenants (worker fair share), and
    `max_cached_blocks` cached device blocks before its own are evicted first (None: the
    worker's default fraction). `name` "" is no tenant: no fair share and no cap.
    `busy_tenants` (set by the router): the tenants busy at the router when it sent the
    request, this one included; 2 or more marks the request as shared, so a worker that holds
    only this tenant's requests still keeps its steps short (worker/engine/fairness.py)."""

    name: str = ""
    weight: float = 1.0
    max_cached_blocks: int | None = None
    busy_tenants: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0 or self.weight != self.weight:
            raise ValueError(f"tenant weight={self.weight!r} must be > 0")
        if self.max_cached_blocks is not None and self.max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks={self.max_cached_blocks!r} must be >= 0")
        if self.busy_tenants < 0:
            raise ValueError(f"busy_tenants={self.busy_tenants!r} must be >= 0")

    @property
    def shared(self) -> bool:
        """Another tenant was busy at the router when this request was sent."""
        return self.busy_tenants >= 2


NO_TENANT = TenantShare()


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """Exactly one of text / token_ids / chat is set. `cache_salt` ("" = none) keys the
    request's blocks apart from other salts' (kvstore.keys.cache_salt_root);
    `max_tokens_given` is False when `params.max_tokens` is the front's default, which the
    router may then shorten to fit the context instead of rejecting the request.
    `resume_tokens` > 0 (only with token_ids): the last that many ids are output already
    generated (a migrated request). `tenant`: who sent it (set by the router).
    `prefill_only`: compute the prompt, keep its full blocks cached, finish without sampling
    (the prefill hop of disaggregated serving). `shared_prefix_blocks`: the prompt's leading
    full blocks the router expects other requests to share (protected from their first use)."""

    request_id: str
    text: str | None
    token_ids: tuple[int, ...] | None
    chat: tuple[ChatMessage, ...] | None
    params: SamplingParams
    priority: int = 0
    peer_hints: tuple[PeerHint, ...] = ()
    cache_salt: str = ""
    max_tokens_given: bool = True
    resume_tokens: int = 0
    tenant: TenantShare = NO_TENANT
    prefill_only: bool = False
    shared_prefix_blocks: int = 0


@dataclass(frozen=True, slots=True)
class SendBlocksInput:
    """A validated SendBlocksRequest; `block_hashes` as 128-bit ints (kvstore.keys.BlockHash).
    The pair fields name the caller's pair (worker.peer.plane)."""

    block_hashes: tuple[int, ...]
    transfer_id: int
    pair_key: str = ""
    new_pair: bool = False
    store_address: str = ""
    receiver_id: str = ""
    receiver_generation: int = 0
    sender_id: str = ""
    sender_generation: int = 0


MAX_CACHE_SALT_CHARS = 1024   # a longer cache_salt is a 400 / INVALID_ARGUMENT
MAX_SEND_BLOCKS = 1 << 16   # hashes in one SendBlocksRequest (a 1M-token prefix at block size 16)
MAX_PAIR_KEY = 256         # characters of a pair key or worker id in a SendBlocksRequest


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> str:
    """OpenAI's message for a prompt plus `max_tokens` beyond the context, naming the field
    (router and worker reject alike: HTTP 400 with param max_tokens, INVALID_ARGUMENT)."""
    return (f"max_tokens: This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
            f"in the completion). Please reduce the length of the messages or completion.")
