"""Pending blocks shared between router replicas: one Redis stream per cluster
(`kvmesh:<cluster>:pending`) on which every router writes what it has sent to which worker
and reads what the others sent.

A router that sends a request records the prompt's blocks as *pending* on the chosen worker
(router/index/blocks.py `add_pending`): a prediction the worker is computing them, which draws
the next request for that prefix to the same worker before the worker's `BlockStored` events
arrive. Replicas behind one Service see different requests, so without sharing each predicts
only its own. `PendingLog` carries three kinds of `PendingNote` per request attempt: SENT
(worker, blocks, prompt tokens the worker computes), PREFILLED (its first response came) and
DONE (it ended; `streamed` says whether it got as far as a response); and ALIVE, a router's
heartbeat, so that the others end the attempts of a router that died. The router side
(router/routing/replicas.py) applies other routers' notes to its index and prefill queue.

Entries carry no secrets; the stream is trimmed to about `maxlen` entries. A reader starts at
the stream's end (notes older than its start are covered by the workers' events). Redis errors
surface as `MetadataError` (the caller retries). redis.asyncio, on the router's loop.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, cast

from kvstore.events import WorkerId
from kvstore.keys import BlockHash, block_hash_from_hex, block_hash_hex
from kvstore.metadata.connection import AsyncLink, ClientOptions
from kvstore.metadata.registry import RedisConfig, redis_errors

__all__ = ["NoteKind", "PendingLog", "PendingNote", "pending_stream"]

_FIELDS = ("kind", "router", "request", "worker", "hashes", "tokens", "streamed")


class NoteKind(enum.Enum):
    SENT = "sent"
    PREFILLED = "prefilled"
    DONE = "done"
    ALIVE = "alive"


class PendingNote(NamedTuple):
    """One step of one request attempt of router `router_id`. `hashes` and `queued_tokens`
    (prompt tokens the worker computes) are set on SENT; `streamed` on DONE."""

    kind: NoteKind
    router_id: str
    request_id: str
    worker_id: WorkerId = WorkerId("")
    hashes: tuple[BlockHash, ...] = ()
    queued_tokens: int = 0
    streamed: bool = False

    def encode(self) -> dict[str, str]:
        return {"kind": self.kind.value, "router": self.router_id, "request": self.request_id,
                "worker": self.worker_id, "hashes": ",".join(block_hash_hex(h) for h in self.hashes),
                "tokens": str(self.queued_tokens), "streamed": "1" if self.streamed else "0"}

    @classmethod
    def decode(cls, fields: dict[str, str]) -> PendingNote:
        """Raises ValueError on an entry that is not a note."""
        if any(f not in fields for f in _FIELDS):
            raise ValueError(f"a pending note lacks {[f for f in _FIELDS if f not in fields]}")
        raw = fields["hashes"]
        return cls(NoteKind(fields["kind"]), fields["router"], fields["request"], WorkerId(fields["worker"]),
                   tuple(block_hash_from_hex(h) for h in raw.split(",")) if raw else (),
                   int(fields["tokens"]), fields["streamed"] == "1")


def pending_stream(config: RedisConfig) -> str:
    """The cluster's pending-notes stream."""
    return config.keys.prefix + "pending"


class PendingLog:
    """One router's end of the shared stream: `publish` its notes, `read` the others'.
    Call `aclose` when done."""

    def __init__(self, config: RedisConfig, router_id: str, maxlen: int = 10_000, block_ms: int = 50) -> None:
        if not router_id or "," in router_id:
            raise ValueError(f"router_id={router_id!r} must be non-empty without commas")
        if maxlen < 1 or block_ms < 1:
            raise ValueError(f"maxlen={maxlen!r} and block_ms={block_ms!r} must be >= 1")
        self.config, self.router_id = config, router_id
        self.maxlen, self.block_ms = maxlen, block_ms
        self.key = pending_stream(config)
        # one Redis, a cluster (the stream is one key: one node) or Sentinel, detected at first use
        self._link = AsyncLink(config.url, ClientOptions(config.socket_timeout_s, block_ms / 1000))
        self._last_id = "$"
        self.published = self.received = self.bad_entries = 0

    async def publish(self, notes: Sequence[PendingNote]) -> None:
        """Append `notes` (this router's) in one round trip. Raises MetadataError."""
        if not notes:
            return
        with redis_errors("publish pending notes"):
            async with (await self._link.client()).pipeline(transaction=False) as pipe:
                for note in notes:
                    pipe.xadd(self.key, note.encode(),  # type: ignore[arg-type]  # a dict[str, str] is a FieldT map
                              maxlen=self.maxlen, approximate=True)
                await pipe.execute()
        self.published += len(notes)

    async def read(self, count: int = 1000) -> list[PendingNote]:
        """The other routers' notes written since the last read (the first read: since the
        stream's end when it was made), waiting up to `block_ms` for one. Raises MetadataError."""
        if self._last_id == "$":
            with redis_errors("read the pending stream's end"):
                info = cast(list[object], await (await self._link.client()).xrevrange(self.key, count=1))
            self._last_id = str(cast(tuple[str, object], info[0])[0]) if info else "0-0"
        with redis_errors("read pending notes"):
            reply = await (await self._link.client()).xread({self.key: self._last_id}, count=count,
                                                             block=self.block_ms)
        out: list[PendingNote] = []
        for _key, entries in cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply or []):
            for entry_id, fields in entries:
                self._last_id = entry_id
                try:
                    note = PendingNote.decode(fields)
                except ValueError:
                    self.bad_entries += 1
                    continue
                if note.router_id != self.router_id:
                    out.append(note)
        self.received += len(out)
        return out

    async def aclose(self) -> None:
        await self._link.aclose()
