"""KV events on the wire: what a worker tells the router about the blocks it holds.

Pure data and bookkeeping, no Redis (the Redis side is `kvstore.metadata.registry`). One stream
entry is one `WireEvent` plus its `epoch` and `seq`, encoded as flat string fields:

    type    stored | removed | cleared | inventory_begin | inventory_end
    seq     1, 2, 3, ... per worker and epoch, one per entry, no holes
    epoch   the worker's generation: its start counter (a restarted worker has a higher one)
    hashes  block hashes as 32-char hex, comma-joined (a batch; "" for none)
    parent  hex hash of the block before hashes[0] ("" for none or unknown)
    tier    device | host | disk (default device)

`stored` says the worker now holds `hashes` in `tier`; a batch of stored hashes is a chain
(each one's parent is the one before it, the first one's parent is `parent`). `removed`
says it no longer holds them in `tier`; `cleared` drops every hash it holds in `tier`.
`inventory_begin` … `inventory_end` bracket a full snapshot: begin means "forget all I said
before", the `stored` entries between them are everything the worker holds.

A consumer checks `seq`/`epoch` with a `WorkerCursor`: any entry that is not the next one
(a hole, a repeat, a new epoch) means its picture of that worker may be wrong. Generations are
fenced: an entry of an epoch below the highest one known for the worker (from its stream or
the registry) comes from an earlier incarnation (a process still winding down, a stream read
again from its start) and is dropped (`Verdict.STALE`); the index fences the same way
(`IndexSink.apply`'s `generation`).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple, NewType, Protocol

from kvstore.errors import KVStoreError
from kvstore.keys import BlockHash, block_hash_from_hex, block_hash_hex
from kvstore.pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

WorkerId = NewType("WorkerId", str)

MAX_HASHES_PER_ENTRY = 256  # 33 bytes a hash on the wire: ~8 KiB entries


class Tier(enum.Enum):
    """Where a worker holds a block, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class TieredEvent(NamedTuple):
    """A pool-style event of one tier (what `kvstore.store.KVStore.take_events` returns)."""

    tier: Tier
    event: KVEvent


class EventType(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    INVENTORY_BEGIN = "inventory_begin"
    INVENTORY_END = "inventory_end"


class EventDecodeError(KVStoreError):
    """A stream entry is not a valid wire event (another writer, or a newer format)."""


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One stream entry's content (see the module docstring for the meaning of each type)."""

    type: EventType
    hashes: tuple[BlockHash, ...] = ()
    parent: BlockHash | None = None
    tier: Tier = Tier.DEVICE

    def __post_init__(self) -> None:
        if not isinstance(self.type, EventType):
            raise ValueError(f"type={self.type!r} must be an EventType")
        if not isinstance(self.tier, Tier):
            raise ValueError(f"tier={self.tier!r} must be a Tier")
        object.__setattr__(self, "hashes", tuple(self.hashes))
        if self.hashes and self.type not in (EventType.STORED, EventType.REMOVED):
            raise ValueError(f"hashes: a {self.type.value} event carries none")
        if len(self.hashes) > MAX_HASHES_PER_ENTRY:
            raise ValueError(f"hashes: {len(self.hashes)} > {MAX_HASHES_PER_ENTRY} per entry")


@dataclass(frozen=True, slots=True)
class SequencedEvent:
    """A `WireEvent` with its place in the worker's stream."""

    epoch: int
    seq: int
    event: WireEvent


def encode_event(event: WireEvent, epoch: int, seq: int) -> dict[str, str]:
    """The stream entry fields of `event`."""
    return {
        "type": event.type.value,
        "seq": str(seq),
        "epoch": str(epoch),
        "hashes": ",".join(block_hash_hex(h) for h in event.hashes),
        "parent": "" if event.parent is None else block_hash_hex(event.parent),
        "tier": event.tier.value,
    }


def decode_event(fields: Mapping[str, str]) -> SequencedEvent:
    """Inverse of `encode_event`; raises EventDecodeError naming what is wrong."""
    try:
        type_ = EventType(fields["type"])
        tier = Tier(fields.get("tier") or Tier.DEVICE.value)
        seq, epoch = int(fields["seq"]), int(fields["epoch"])
        raw = fields.get("hashes", "")
        hashes = tuple(block_hash_from_hex(h) for h in raw.split(",")) if raw else ()
        parent = block_hash_from_hex(fields["parent"]) if fields.get("parent") else None
        return SequencedEvent(epoch, seq, WireEvent(type_, hashes, parent, tier))
    except (KeyError, ValueError) as e:
        raise EventDecodeError(f"bad event entry {dict(fields)!r}: {e}") from None


def from_pool_events(events: Iterable[KVEvent], tier: Tier = Tier.DEVICE) -> list[WireEvent]:
    """Batch `BlockPool.take_events()` output into wire events, keeping their order.

    Consecutive `BlockStored` events join one entry while each one's parent is the hash
    before it (a prefix being cached block by block); consecutive `BlockRemoved` join one.
    """
    out: list[WireEvent] = []
    run: list[BlockHash] = []
    run_type: EventType | None = None
    run_parent: BlockHash | None = None

    def flush() -> None:
        if run_type is not None:
            out.append(WireEvent(run_type, tuple(run), run_parent, tier))
        run.clear()

    for ev in events:
        if isinstance(ev, BlockStored):
            if run_type is not EventType.STORED or ev.parent_hash != run[-1] \
                    or len(run) == MAX_HASHES_PER_ENTRY:
                flush()
                run_type, run_parent = EventType.STORED, ev.parent_hash
            run.append(ev.block_hash)
        elif isinstance(ev, BlockRemoved):
            if run_type is not EventType.REMOVED or len(run) == MAX_HASHES_PER_ENTRY:
                flush()
                run_type, run_parent = EventType.REMOVED, None
            run.append(ev.block_hash)
        else:
            assert isinstance(ev, AllBlocksCleared), f"unknown KV event {ev!r}"
            flush()
            run_type = None
            out.append(WireEvent(EventType.CLEARED, tier=tier))
    flush()
    return out


def from_tiered_events(events: Iterable[TieredEvent]) -> list[WireEvent]:
    """`from_pool_events` over a mixed log: each run of one tier batched, order kept."""
    out: list[WireEvent] = []
    for tier, run in groupby(events, key=lambda e: e.tier):
        out.extend(from_pool_events((e.event for e in run), tier))
    return out


def inventory_events(hashes_by_tier: Mapping[Tier, Sequence[BlockHash]]) -> list[WireEvent]:
    """A full snapshot: begin, the stored batches of every tier, end."""
    out = [WireEvent(EventType.INVENTORY_BEGIN)]
    for tier in Tier:
        hashes = list(hashes_by_tier.get(tier, ()))
        for start in range(0, len(hashes), MAX_HASHES_PER_ENTRY):
            out.append(WireEvent(EventType.STORED,
                                 tuple(hashes[start:start + MAX_HASHES_PER_ENTRY]), None, tier))
    out.append(WireEvent(EventType.INVENTORY_END))
    return out


class Verdict(enum.Enum):
    """What a consumer learns from one entry's `epoch`/`seq`."""

    NEXT = "next"            # the expected entry: apply it
    GAP = "gap"              # entries were lost or repeated: the picture may be wrong
    NEW_EPOCH = "new_epoch"  # the worker restarted: everything known about it is stale
    STALE = "stale"          # from an earlier generation of the worker: drop it


@dataclass(slots=True)
class WorkerCursor:
    """A consumer's position in one worker's stream (mutable, owned by the consumer).

    `last_id`: the stream id read up to; `epoch`/`next_seq`: what the next entry should
    carry (None: unknown yet, the next entry is taken as it comes); `record_epoch`: the
    epoch the registry last showed for this worker.
    """

    last_id: str = "0-0"
    epoch: int | None = None
    next_seq: int | None = None
    record_epoch: int | None = None

    def check(self, epoch: int, seq: int) -> Verdict:
        """Judge the entry (epoch, seq) and move past it (a STALE one leaves the cursor as it was)."""
        known = max((e for e in (self.epoch, self.record_epoch) if e is not None), default=None)
        if known is not None and epoch < known:
            return Verdict.STALE
        if self.epoch is None or self.next_seq is None:
            verdict = Verdict.NEXT if self.epoch in (None, epoch) else Verdict.NEW_EPOCH
        elif epoch != self.epoch:
            verdict = Verdict.NEW_EPOCH
        else:
            verdict = Verdict.NEXT if seq == self.next_seq else Verdict.GAP
        self.epoch, self.next_seq = epoch, seq + 1
        return verdict


class IndexSink(Protocol):
    """What a consumer feeds: the router's block-location index (`router.index.blocks.BlockIndex`)."""

    def apply(self, worker_id: WorkerId, event: WireEvent, generation: int | None = None) -> None:
        """Apply `event` of `worker_id`, sent by its incarnation `generation` (the entry's
        epoch; None: unknown): one below the highest seen for the worker is dropped."""

    def clear_worker(self, worker_id: WorkerId) -> None: ...

    def remove_worker(self, worker_id: WorkerId) -> None: ...
