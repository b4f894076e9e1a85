"""Peer transfer in the worker: its pairs, the owner's side of `SendBlocks`, and
fetch-or-recompute for a request that arrives with a peer hint.

Start (`PeerPlane.start`, blocking, before the engine thread runs): measure prefill tokens/s
with a short prefill on the engine and the checksum rate, attach a staging host tier to its KV
store if it has none (sized for one max_model_len prompt), draw this start's generation, and
host the rendezvous store for the pairs this worker will receive on. No group is formed and
no peer is waited for: pairs form on first use (`kvstore.transfer.pairs`), so a worker joins, leaves
or restarts without anyone else noticing but its pairs. Real prefills raise the prefill
figure later (`observe_prefill`).

Pull, for a request hinted "worker W holds the first N blocks" (`fetch`) — plan → SendBlocks →
`store.stage` → admission:
  1. `AsyncEngine.count_held`: the leading prompt blocks the KV store holds, answered beside
     a running step (the `CountHeld` command would wait for its end);
  2. the cost model (`kvstore.transfer.cost.CostModel`) weighs fetching the missing ones
     against prefilling their tokens (with W's measured link, or `ASSUMED_LINK` before the
     first pair with W formed); recompute unless fetching is cheaper;
  3. ask W over gRPC to send them (`AskPeer`, the server's `SendBlocks` call) on our pair with
     W — the live one, or a new key with `new_pair` (then both join the rendezvous this worker
     hosts, and measure the link). W answers how many it sends, and only then is the receive
     posted; W answering `pair_unknown` (it restarted, or dropped the pair) makes this worker
     form a new pair and ask once more;
  4. the verified leading run of what arrived is handed back as a `StageBlocks` command that
     the request's `AddRequest` carries, so admission onloads them like any host hit.
Any failure (RPC error, dead peer, timeout, bad checksum) keeps only the good leading run,
possibly nothing: the engine recomputes the rest, and the output is the same. A failed
transfer breaks its pair only (`Pairs.broken`); the next fetch forms a new one.

Send, for a peer's `SendBlocks` (`serve_send`): `AsyncEngine.read_blocks` copies the leading
run of the asked hashes held in the store (beside a running step where the store can check
the copy, a CPU pool; else the `ReadBlocks` engine command, between steps), then the copy is
queued on the `BlockTransfer` once the pair is ready (at once for a live pair; after joining
for a new one, in a thread bounded by the connect timeout), whose own threads wait for the
network.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from contracts.requests import PeerHint, SendBlocksInput
from kvstore.keys import BlockHash, block_hashes, cache_salt_root
from kvstore.transfer.blocks import MAX_TRANSFER_ID, BlockSpec, BlockTransfer, SendResult
from kvstore.transfer.cost import LinkEstimate, measure_checksum
from kvstore.transfer.group import PairGroup, PeerId, RendezvousStore, TransferError
from kvstore.transfer.pairs import Pairs, Slot
from worker.engine.async_engine import AsyncEngine, StageBlocks
from worker.kernels import native
from worker.peer.config import AskPeer, Fetched, PeerConfig, PeerCounters, PeerFigures
from worker.peer.errors import FetchCause, FetchFailure, InvalidPeerRequest, PeerUnavailable
from worker.peer.plan import Decision, FaultPlan, FetchPlan, PlanView, good_leading_run, plan_fetch

if TYPE_CHECKING:
    from worker.engine.engine import Engine

log = logging.getLogger("kvmesh.peer")


class PeerPlane:
    """One worker's side of peer transfer (see the module docstring). Thread-safe counters;
    `fetch` and `serve_send` run on the server's event loop."""

    def __init__(self, engine: Engine, cfg: PeerConfig, prefill_tokens_per_s: float, checksum_bytes_s: float,
                 generation: int | None = None) -> None:
        """Hosts the rendezvous store (TransferError if it cannot bind) and starts the transfer
        threads; measures nothing (see `start`)."""
        self.me = PeerId(cfg.worker_id, time.time_ns() if generation is None else generation)
        self.prefill_tokens_per_s, self.checksum_bytes_s = prefill_tokens_per_s, checksum_bytes_s
        self.spec = BlockSpec.of(engine.store.kv.kv)
        self.block_size = engine.cfg.block_size
        self.salt = engine.salt
        self.host_num_blocks = engine.store.host_num_blocks   # the staging capacity
        self.backend = cfg.transfer.resolve_backend(engine.device)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._c = PeerCounters()
        self.fetch_observer: Callable[[float], None] | None = None   # each fetch's seconds (worker/server/metrics.py)
        self._links: dict[str, LinkEstimate] = {}
        self._lost: dict[str, str] = {}
        store = RendezvousStore(cfg.store_host, cfg.store_port, cfg.transfer.connect_timeout_s)
        self.transfer = BlockTransfer(cfg.transfer.timeout_s, FaultPlan(cfg.faults) if cfg.faults else None,
                                      on_broken=self._broken, checksum_kernel=native.checksum_kernel())
        self.pairs = Pairs(self.me, cfg.transfer, engine.device, store, store.address(cfg.advertise_host),
                           self.transfer, on_link=self._linked)

    @classmethod
    def start(cls, cfg: PeerConfig, engine: Engine) -> PeerPlane:
        """Measure, attach the staging tier, host the rendezvous store. Waits for no peer."""
        prefill = engine.measure_prefill(cfg.prefill_probe_tokens)
        checksum = measure_checksum(kernel=native.checksum_kernel())
        engine.store.ensure_host_tier(engine.layout.blocks_for(engine.max_model_len))
        plane = cls(engine, cfg, prefill, checksum)
        log.info("peer plane of %s: store %s, prefill %.0f tokens/s, checksums %.2f GB/s", plane.me,
                 plane.pairs.store_address, prefill, checksum / 1e9)
        return plane

    @property
    def worker_id(self) -> str:
        return self.me.worker_id

    def close(self, timeout_s: float = 5.0) -> None:
        self.pairs.close()
        self.transfer.close(timeout_s)

    def _linked(self, worker_id: str, link: LinkEstimate) -> None:
        with self._lock:
            self._links[worker_id] = link
            self._lost.pop(worker_id, None)

    def _broken(self, pair: PairGroup, reason: str) -> None:
        with self._lock:
            self._lost[pair.peer.worker_id] = reason
        self.pairs.broken(pair, reason)

    # -- the owner: SendBlocks ------------------------------------------------------------
    async def serve_send(self, ae: AsyncEngine, req: SendBlocksInput,
                         still_wanted: Callable[[], bool]) -> tuple[int, int, str, bool]:
        """Queue the send of the leading run of `req.block_hashes` held here on the caller's
        pair; returns (num_blocks, num_bytes, reason when fewer than asked, pair_unknown).
        Raises InvalidPeerRequest. Nothing is sent when `still_wanted()` turns False while
        the blocks are copied (the caller's deadline is near)."""
        if req.sender_id and req.sender_id != self.worker_id:
            raise InvalidPeerRequest(f"sender_id: {req.sender_id!r}, but this worker is {self.worker_id!r}")
        if req.receiver_id == self.worker_id:
            raise InvalidPeerRequest(f"receiver_id: {req.receiver_id!r} is this worker")
        if req.transfer_id > MAX_TRANSFER_ID:
            raise InvalidPeerRequest(f"transfer_id: {req.transfer_id} exceeds {MAX_TRANSFER_ID}")
        slot = None if req.new_pair else self.pairs.sending(req.pair_key)
        stale = req.sender_generation not in (0, self.me.generation)
        if not req.new_pair and (slot is None or stale or slot.peer_id != req.receiver_id):
            return 0, 0, f"no live pair {req.pair_key!r} here (this is {self.me})", True
        hashes = tuple(BlockHash(h) for h in req.block_hashes)
        held = await ae.read_blocks(hashes, self.pairs.device)
        if held.blocks is None:
            return 0, 0, "none of the blocks is held here", False
        if not still_wanted():
            return 0, 0, "too late: the caller's deadline is near", False
        if slot is None:
            receiver = PeerId(req.receiver_id, req.receiver_generation)
            slot = self.pairs.form_sending(req.pair_key, receiver, req.store_address)
            if slot is None:
                return 0, 0, "busy: too many pairs forming, or the key is taken", False
        self._send_when_ready(slot, req.transfer_id, held.blocks, hashes[:held.num_blocks])
        reason = "" if held.num_blocks == len(hashes) else f"holds the first {held.num_blocks} of {len(hashes)}"
        return held.num_blocks, held.num_blocks * self.spec.bytes_per_block, reason, False

    def _send_when_ready(self, slot: Slot, transfer_id: int, blocks: torch.Tensor,
                         hashes: Sequence[BlockHash]) -> None:
        def go(ready: Future[PairGroup]) -> None:
            if ready.exception() is not None:
                self._count_send_failure(ready.exception())
                return
            try:
                future = self.transfer.send(ready.result(), transfer_id, blocks, hashes)
            except RuntimeError as e:      # the transfer is closed: the worker is stopping
                self._count_send_failure(e)
                return
            future.add_done_callback(self._sent)
        slot.ready.add_done_callback(go)

    def _count_send_failure(self, error: BaseException | None) -> None:
        with self._lock:
            self._c.send_failures += 1
        log.warning("send failed: %s", error)

    def _sent(self, future: Future[SendResult]) -> None:
        if future.exception() is not None:
            self._count_send_failure(future.exception())
            return
        with self._lock:
            self._c.blocks_sent += future.result().num_blocks
            self._c.bytes_sent += future.result().num_bytes

    # -- the puller: fetch-or-recompute ---------------------------------------------------
    def view(self) -> PlanView:
        with self._lock:
            links = dict(self._links)
        return PlanView(self.worker_id, links, self.prefill_tokens_per_s, self.checksum_bytes_s,
                        self.spec.bytes_per_block, self.block_size)

    async def fetch(self, ae: AsyncEngine, token_ids: Sequence[int], hints: Sequence[PeerHint],
                    ask: AskPeer, cache_salt: str = "", force: bool = False,
                    on_failed: Callable[[FetchFailure], None] | None = None) -> Fetched | None:
        """Fetch what the cost model says to (everything the hint holds and this worker lacks
        with `force`: a disaggregated hand-off); None when nothing usable arrived (or was
        asked). `cache_salt` is the request's (the hashes must be the ones its admission looks
        up). `on_failed` hears why a fetch that was tried brought nothing usable."""
        bs = self.block_size
        # admission recomputes at least the last prompt token: only blocks before it count
        hashes = block_hashes(list(token_ids[:(len(token_ids) - 1) // bs * bs]), bs, self.salt,
                              cache_salt_root(cache_salt))
        assert self.host_num_blocks > 0, "PeerPlane.start attaches a host tier"
        num_local = ae.count_held(hashes)
        # stage no more than the host tier holds beside this prompt's own blocks (which may
        # be there too): storing more would push the prompt's head out of its LRU
        plan = plan_fetch(hashes, num_local, max(self.host_num_blocks - num_local, 0), hints, self.view(), force)
        self.record_plan(plan)
        if plan.decision is not Decision.FETCH:
            return None
        assert plan.hint is not None
        t0 = time.perf_counter()
        try:
            stored = await self._pull(plan, plan.hint, ask)
            if isinstance(stored, FetchFailure):
                if on_failed is not None:
                    on_failed(stored)
                return None
        finally:
            self.observe_fetch(time.perf_counter() - t0)
        keep, blocks = stored
        return Fetched(StageBlocks(tuple(keep), blocks), plan.num_local, len(keep))

    async def pull(self, ae: AsyncEngine, hint: PeerHint, hashes: Sequence[BlockHash],
                   ask: AskPeer) -> int:
        """Fetch the leading run of `hashes` that `hint`'s worker holds, without weighing
        recompute, and stage it into the host tier (a drain hand-over, a warm start); returns
        how many blocks were stored (0 on any failure, counted as a fetch's)."""
        plan = FetchPlan(Decision.FETCH, hint, tuple(hashes), 0, 0.0, 0.0)
        stored = await self._pull(plan, hint, ask)
        if stored is None or type(stored) is not tuple:    # nothing usable arrived (logged, counted)
            return 0
        keep, blocks = cast(tuple[list[BlockHash], torch.Tensor], stored)
        await ae.run(StageBlocks(tuple(keep), blocks))
        return len(keep)

    async def _pair_for(self, sender_id: str) -> tuple[Slot, bool]:
        """The live (or forming) pair with `sender_id`, else a new key: (slot, is_new)."""
        slot = self.pairs.receiving(sender_id)
        if slot is not None:
            try:
                await asyncio.shield(asyncio.wrap_future(slot.ready))
                return slot, False
            except TransferError:
                pass                       # it did not form: a new one below
        return self.pairs.new_receiving(sender_id), True

    async def _ask(self, hint: PeerHint, plan: FetchPlan, transfer_id: int,
                   ask: AskPeer) -> tuple[Slot, PairGroup, int] | FetchFailure:
        """Ask the peer to send on our pair with it (one retry on a new pair when it knows
        ours no more); the pair ready to receive on and the blocks coming, or why none."""
        for _ in range(2):
            slot, new = await self._pair_for(hint.worker_id)
            old = None if new else slot.ready.result()
            fields = dict(pair_key=slot.key, new_pair=new, store_address=self.pairs.store_address,
                          receiver_id=self.worker_id, receiver_generation=self.me.generation,
                          sender_id=hint.worker_id, sender_generation=0 if old is None else old.peer.generation)
            try:
                answer = await ask(hint.address, plan.block_hashes, transfer_id, fields)
            except asyncio.CancelledError:   # a hand-off's deadline: a new slot must not stay forming
                if new:
                    self.pairs.abandon(slot)
                raise
            except PeerUnavailable as e:
                if new:
                    self.pairs.abandon(slot)
                return FetchFailure(FetchCause.UNAVAILABLE, f"SendBlocks to {hint.address}: {e}")
            if answer.pair_unknown and not new:
                assert old is not None
                self._broken(old, f"{hint.worker_id} knows pair {slot.key} no more")
                continue
            if answer.num_blocks <= 0:
                if new:
                    self.pairs.abandon(slot)
                return FetchFailure(FetchCause.NOT_HELD,
                                    f"{hint.worker_id} sends none of the {len(plan.block_hashes)} blocks")
            if not new:
                assert old is not None
                return slot, old, answer.num_blocks
            try:
                pair = await asyncio.to_thread(self.pairs.form_receiving, slot,
                                               PeerId(hint.worker_id, answer.generation))
            except TransferError as e:
                return FetchFailure(FetchCause.TRANSFER, str(e))
            return slot, pair, answer.num_blocks
        return FetchFailure(FetchCause.UNAVAILABLE, f"{hint.worker_id} knows none of our pairs")

    async def _pull(self, plan: FetchPlan, hint: PeerHint,
                    ask: AskPeer) -> tuple[list[BlockHash], torch.Tensor] | FetchFailure:
        transfer_id = self.next_transfer_id()
        asked = await self._ask(hint, plan, transfer_id, ask)
        if isinstance(asked, FetchFailure):
            return self.failed(asked)
        _, pair, n = asked
        return await self.receive(plan, pair, transfer_id, n)

    def next_transfer_id(self) -> int:
        return next(self._ids) % (MAX_TRANSFER_ID + 1)

    async def ask_for(self, hint: PeerHint, plan: FetchPlan, transfer_id: int,
                      ask: AskPeer) -> tuple[PairGroup, int] | FetchFailure:
        """Ask `hint`'s worker to send the leading run of `plan.block_hashes` it holds: the pair
        to receive on and how many blocks come, or why none (not counted as a failure here)."""
        asked = await self._ask(hint, plan, transfer_id, ask)
        return asked if isinstance(asked, FetchFailure) else asked[1:]

    async def receive(self, plan: FetchPlan, pair: PairGroup, transfer_id: int,
                      n: int) -> tuple[list[BlockHash], torch.Tensor] | FetchFailure:
        """Receive the `n` blocks a peer agreed to send; the verified leading run of them."""
        # Post the receive at once and never cancel it: a send nobody receives breaks the pair.
        future = self.transfer.recv(pair, transfer_id, n, self.spec)
        try:
            got = await asyncio.shield(asyncio.wrap_future(future))
        except TransferError as e:
            return self.failed(FetchFailure(FetchCause.TRANSFER, str(e)))
        k = good_leading_run(got.block_hashes, got.ok, plan.block_hashes)
        with self._lock:
            self._c.blocks_bad += len(got.bad_indices)
            self._c.blocks_fetched += k
            self._c.bytes_fetched += k * self.spec.bytes_per_block
        if k < n:
            log.warning("from %s: %d of %d blocks usable (bad: %s); recomputing the rest",
                        pair.peer, k, n, got.bad_indices)
        if k == 0:
            return FetchFailure(FetchCause.BAD_CHECKSUM, f"block 0 of {n} from {pair.peer} failed its check")
        return list(plan.block_hashes[:k]), got.blocks[:, :, :k]   # [L, 2, k, bs, H, D]

    def failed(self, failure: FetchFailure) -> FetchFailure:
        """Log and count a fetch that brought nothing usable."""
        log.warning("fetch failed (%s), recomputing: %s", failure.cause.value, failure.why)
        with self._lock:
            self._c.fetch_failures += 1
        return failure

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A real request computed `num_tokens` prompt tokens before its first token in
        `seconds`: keep the best rate seen (the start-up probe may have run while other
        workers were loading). An optimistic prefill rate makes the model fetch only when
        that is clearly cheaper than recomputing."""
        if num_tokens >= 32 and seconds > 0:
            with self._lock:
                self.prefill_tokens_per_s = max(self.prefill_tokens_per_s, num_tokens / seconds)

    def observe_fetch(self, seconds: float) -> None:
        with self._lock:
            self._c.fetch_seconds += seconds
        if self.fetch_observer is not None:
            self.fetch_observer(seconds)

    def record_plan(self, plan: FetchPlan) -> None:
        with self._lock:
            self._c.last_decision = plan.decision.value
            self._c.last_fetch_estimate_s, self._c.last_recompute_estimate_s = plan.fetch_s, plan.recompute_s
            self._c.fetch_decisions += plan.decision is Decision.FETCH
            self._c.recompute_decisions += plan.decision is Decision.RECOMPUTE

    def figures(self) -> PeerFigures:
        formed, broken = self.pairs.counts()
        with self._lock:
            return PeerFigures(self.me, self.pairs.store_address, self.backend, self.prefill_tokens_per_s,
                               self.checksum_bytes_s, dict(self._links), dict(self._lost), formed, broken,
                               replace(self._c))
