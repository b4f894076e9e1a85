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
    """A peer that holds the first `num_blocks` blocks of the prompt (router -> worker)."""

    worker_id: str
    address: str
    rank: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """Exactly one of text / token_ids / chat is set. `resume_tokens` > 0 (only with
    token_ids): the last that many ids are output already generated (a migrated request)."""

    request_id: str
    text: str | None
    token_ids: tuple[int, ...] | None
    chat: tuple[ChatMessage, ...] | None
    params: SamplingParams
    priority: int = 0
    peer_hints: tuple[PeerHint, ...] = ()
    resume_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SendBlocksInput:
    """A validated SendBlocksRequest; `block_hashes` as 128-bit ints (kvstore.keys.BlockHash).
    The pair fields name the caller's pair (worker.peer); the legacy ranks are ignored."""

    block_hashes: tuple[int, ...]
    dst_rank: int
    src_rank: int
    transfer_id: int
    pair_key: str = ""
    new_pair: bool = False
    store_address: str = ""
    receiver_id: str = ""
    receiver_generation: int = 0
    sender_id: str = ""
    sender_generation: int = 0


MAX_SEND_BLOCKS = 1 << 16   # hashes in one SendBlocksRequest (a 1M-token prefix at block size 16)
MAX_PAIR_KEY = 256         # characters of a pair key or worker id in a SendBlocksRequest
