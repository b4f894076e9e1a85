"""The pairs of one worker, formed on demand and torn down on failure (see `kvstore.transfer.group`).

A pair is directional: its receiver (member 0) hosts the rendezvous store and names the pair
with a fresh random key; its sender (member 1) joins when the receiver's `SendBlocks` asks it
to (`new_pair`). Each side keeps at most one live pair per other worker id:
- as receiver, `receiving(sender_id)` is the current slot (forming or formed); `new_receiving`
  replaces it (the old pair is retired); `form_receiving` joins the rendezvous;
- as sender, `sending(key)` is a pair the receiver named before; `form_sending` starts joining
  a new one in a thread (at most `MAX_FORMING` at once, each bounded by the connect timeout)
  and, once formed, retires this worker's older pairs to the same receiver (a restarted or
  re-keyed receiver leaves none behind). A key that never forms (a rogue or abandoned
  request) costs one bounded thread and nothing else.
Right after forming, both members measure the link (`measure_link`) for the cost model.
A pair that fails (`BlockTransfer` calls `broken`) is dropped from its table and retired;
the next fetch forms a new one.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvstore.transfer.blocks import BlockTransfer
from kvstore.transfer.cost import LinkEstimate, measure_link
from kvstore.transfer.group import PairGroup, PeerId, RendezvousStore, TransferConfig, TransferError, connect_store

log = logging.getLogger("kvmesh.pairs")

MAX_FORMING = 4          # pairs this worker joins as sender at once; more are refused (busy)
LINK_PROBE_BYTES = 4 << 20


@dataclass(slots=True)
class Slot:
    """One pair, forming or formed: `ready` resolves to it (or to TransferError)."""

    key: str
    peer_id: str
    ready: Future[PairGroup] = field(default_factory=Future)


class Pairs:
    """This worker's pairs (thread-safe). `on_link(worker_id, estimate)` gets each
    measurement; `counts()` the pairs formed and broken."""

    def __init__(self, me: PeerId, cfg: TransferConfig, device: torch.device, store: RendezvousStore,
                 store_address: str, transfer: BlockTransfer,
                 on_link: Callable[[str, LinkEstimate], None] | None = None) -> None:
        self.me, self.cfg, self.device, self.transfer = me, cfg, device, transfer
        self.store, self.store_address = store, store_address
        self._on_link = on_link
        self._lock = threading.Lock()
        self._receiving: dict[str, Slot] = {}     # sender worker id -> slot
        self._sending: dict[str, Slot] = {}       # key -> slot
        self._forming = 0
        self._ids = itertools.count(1)
        self.formed = self.broken_count = 0

    # -- as receiver ----------------------------------------------------------------------
    def receiving(self, sender_id: str) -> Slot | None:
        with self._lock:
            return self._receiving.get(sender_id)

    def new_receiving(self, sender_id: str) -> Slot:
        """A fresh key for a pair with `sender_id`, replacing (retiring) the current one."""
        key = f"{self.me}>{sender_id}#{next(self._ids)}.{secrets.token_hex(8)}"
        slot = Slot(key, sender_id)
        with self._lock:
            old = self._receiving.get(sender_id)
            self._receiving[sender_id] = slot
        if old is not None:
            self._discard(old)
        return slot

    def form_receiving(self, slot: Slot, sender: PeerId) -> PairGroup:
        """Join the rendezvous of `slot` as member 0 and measure the link (blocking, bounded
        by the connect timeout); TransferError, and the slot is dropped, when it fails."""
        try:
            pair = self._form(slot.key, self.store.store, 0, sender)
        except TransferError as e:
            self.abandon(slot, e)
            raise
        slot.ready.set_result(pair)
        return pair

    def abandon(self, slot: Slot, error: Exception | None = None) -> None:
        """The receiver gives up on a slot that did not form (its SendBlocks sent nothing)."""
        with self._lock:
            if self._receiving.get(slot.peer_id) is slot:
                del self._receiving[slot.peer_id]
        if not slot.ready.done():
            slot.ready.set_exception(error or TransferError(slot.peer_id, -1, "pair abandoned"))

    # -- as sender ------------------------------------------------------------------------
    def sending(self, key: str) -> Slot | None:
        with self._lock:
            return self._sending.get(key)

    def form_sending(self, key: str, receiver: PeerId, store_address: str) -> Slot | None:
        """Start joining the pair `key` at `store_address` (a thread); None when MAX_FORMING
        pairs are already forming or the key is in use."""
        with self._lock:
            if self._forming >= MAX_FORMING or key in self._sending:
                return None
            self._forming += 1
            slot = self._sending[key] = Slot(key, receiver.worker_id)
        threading.Thread(target=self._join, args=(slot, receiver, store_address), daemon=True,
                         name=f"kvmesh-pair-{receiver}").start()
        return slot

    def _join(self, slot: Slot, receiver: PeerId, store_address: str) -> None:
        try:
            store = connect_store(store_address, self.cfg.connect_timeout_s)
            pair = self._form(slot.key, store, 1, receiver)
        except TransferError as e:
            log.warning("pair %s with %s did not form: %s", slot.key, receiver, e.reason)
            with self._lock:
                self._forming -= 1
                self._sending.pop(slot.key, None)
            slot.ready.set_exception(e)
            return
        with self._lock:
            self._forming -= 1
            older = [s for k, s in self._sending.items() if s.peer_id == receiver.worker_id and k != slot.key]
            for s in older:
                del self._sending[s.key]
        for s in older:
            self._discard(s)
        slot.ready.set_result(pair)

    # -- both -----------------------------------------------------------------------------
    def _form(self, key: str, store: object, member: int, peer: PeerId) -> PairGroup:
        pair = PairGroup.form(key, store, member, peer, self.device, self.cfg)
        try:
            link = measure_link(pair, LINK_PROBE_BYTES, repeats=2, timeout_s=self.cfg.connect_timeout_s)
        except RuntimeError as e:
            pair.close()
            raise TransferError(str(peer), -1, f"measuring the link of pair {key} failed: {e}") from e
        with self._lock:
            self.formed += 1
        if self._on_link is not None:
            self._on_link(peer.worker_id, link)
        log.info("pair %s formed with %s: %.2f GB/s, %.0f us", key, peer, link.bandwidth_bytes_s / 1e9,
                 link.latency_s * 1e6)
        return pair

    def broken(self, pair: PairGroup, reason: str) -> None:
        """`BlockTransfer`'s on_broken: drop the pair; the next use forms a new one."""
        with self._lock:
            self.broken_count += 1
            for table in (self._receiving, self._sending):
                for k, s in list(table.items()):
                    if s.key == pair.key:
                        del table[k]
        log.warning("pair %s with %s broken (formed anew on next use): %s", pair.key, pair.peer, reason)
        self.transfer.retire(pair)

    def _discard(self, slot: Slot) -> None:
        """Retire the slot's pair once formed (or never, if it fails to form)."""
        def retire(f: Future[PairGroup]) -> None:
            if f.exception() is None:
                self.transfer.retire(f.result())
        slot.ready.add_done_callback(retire)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.formed, self.broken_count

    def close(self) -> None:
        """Retire every pair (the transfer's threads close them)."""
        with self._lock:
            slots = list(self._receiving.values()) + list(self._sending.values())
            self._receiving.clear()
            self._sending.clear()
        for slot in slots:
            self._discard(slot)
