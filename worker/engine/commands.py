"""The commands the engine thread accepts (`worker.engine.async_engine.AsyncEngine.run`): a closed
set of frozen dataclasses, each with a typed result, instead of closures over engine
internals. Applied between steps in the order sent, so no step runs while a command reads
the KV store (`ReadBlocks` copies a consistent snapshot of blocks). Torch-free to import:
the server builds them without loading the engine.

| command             | result        | used by                                   |
|---------------------|---------------|-------------------------------------------|
| `AddRequest`        | (outputs)     | `generate` (stages fetched blocks first)  |
| `AbortRequest`      | `bool` found  | the Abort RPC                             |
| `Tokenize`          | token ids     | the server, before a peer fetch           |
| `ApplyChatTemplate` | token ids     | the server, before a peer fetch           |
| `CountHeld`         | `int` blocks  | tests (a fetch uses `count_held`, at once)|
| `ReadBlocks`        | `HeldBlocks`  | the peer plane's `SendBlocks` side        |
| `HottestBlocks`     | block hashes  | HotBlocks (drain hand-over, warm start)   |
| `StageBlocks`       | `int` written | (also inside `AddRequest`)                |
| `Snapshot`          | `EngineStats` | GetLoad, tests                            |
| `ListRequests`      | request ids   | the server's drain                        |
| `ResetPrefixCache`  | `bool` done   | the ResetPrefixCache RPC                  |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from contracts.requests import GenerateInput
from kvstore.keys import BlockHash

if TYPE_CHECKING:
    import torch

    # named in string forward references of the generic bases below (Command["HeldBlocks"])
    from kvstore.store_types import HeldBlocks  # noqa: F401
    from worker.engine.config import EngineStats  # noqa: F401

R = TypeVar("R")


class Command(Generic[R]):
    """Base of the engine commands; `R` is what `AsyncEngine.run` returns for it."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class StageBlocks(Command[int]):
    """Blocks fetched from a peer (`data` as `KVStore.read` returns it) into the host tier."""

    block_hashes: tuple[BlockHash, ...]
    data: torch.Tensor


@dataclass(frozen=True, slots=True)
class AddRequest(Command[None]):
    """Queue the request `spec` (`Engine.add_request`); `staged` blocks are stored right
    before it, with no step between, so its admission finds them. Sent by
    `AsyncEngine.generate`, which streams the outputs."""

    spec: GenerateInput
    staged: StageBlocks | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest(Command[bool]):
    request_id: str


@dataclass(frozen=True, slots=True)
class Tokenize(Command[list[int]]):
    text: str


@dataclass(frozen=True, slots=True)
class ApplyChatTemplate(Command[list[int]]):
    messages: tuple[tuple[str, str], ...]     # (role, content)


@dataclass(frozen=True, slots=True)
class CountHeld(Command[int]):
    """How many leading `block_hashes` admission would find here (device, then host)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class ReadBlocks(Command["HeldBlocks"]):
    """A copy on `device` of the leading run of `block_hashes` held here, for a peer."""

    block_hashes: tuple[BlockHash, ...]
    device: torch.device


@dataclass(frozen=True, slots=True)
class HottestBlocks(Command[tuple[BlockHash, ...]]):
    """Up to `max_blocks` hashes held here, most hit recently first (`KVStore.hottest`)."""

    max_blocks: int


@dataclass(frozen=True, slots=True)
class Snapshot(Command["EngineStats"]):
    """Load, block usage and counters of the engine (GetLoad)."""


@dataclass(frozen=True, slots=True)
class ListRequests(Command[tuple[str, ...]]):
    """The ids of every unfinished request."""


@dataclass(frozen=True, slots=True)
class ResetPrefixCache(Command[bool]):
    """Drop every cached block hash of the device pool (`KVStore.reset_prefix_cache`); False,
    nothing dropped, while a request holds blocks."""
