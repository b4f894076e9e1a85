"""Peer transfer in the worker: the transfer plane it joins at start, the owner's side of
`SendBlocks`, and fetch-or-recompute for a request that arrives with a peer hint.

Start (`PeerPlane.start`, blocking, before the engine thread runs): measure prefill tokens/s
with a short prefill on the engine, attach a staging host tier to its KV store if it has none
(sized for one max_model_len prompt), join
the transfer group (`kvstore.transfer.TransferGroup`), measure the link to every peer (all
ranks in one order, so no two wait on each other) and the checksum rate. Real prefills
raise the prefill figure later (`observe_prefill`: the probe may run while peers load).

Pull, for a request hinted "rank R holds the first N blocks" (`fetch`) — plan → SendBlocks →
`store.stage` → admission:
  1. `CountHeld` (an engine command): the leading prompt blocks the KV store holds, by the
     same lookup admission makes (device pool, then host tier);
  2. the cost model (`kvstore.transfer_cost.CostModel`) weighs fetching the missing ones
     against prefilling their tokens; recompute unless fetching is cheaper;
  3. ask R over gRPC to send them (`AskPeer`, the server's `SendBlocks` call): R answers
     how many it sends, and only then is the receive posted — a gloo send completes only
     when its receive is posted, so this worker never asks for what it would not take;
  4. the verified leading run of what arrived is handed back as a `StageBlocks` command that
     the request's `AddRequest` carries: the engine thread stages the blocks in the store's
     host tier right before adding the request, so admission onloads them like any host hit.
Any failure (RPC error, dead peer, timeout, bad checksum) keeps only the good leading run,
possibly nothing: the engine recomputes the rest, and the output is the same.

Send, for a peer's `SendBlocks` (`serve_send`): `ReadBlocks` (an engine command) copies the
leading run of the asked hashes held in the store (no step runs meanwhile, so no block is
evicted mid-read), then the copy is queued on the `BlockTransfer`, whose own threads wait
for the network.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvstore.keys import BlockHash, block_hashes, cache_salt_root
from kvstore.transfer import MAX_TRANSFER_ID, BlockSpec, BlockTransfer, SendResult
from kvstore.transfer_group import TransferConfig, TransferError, TransferGroup
from kvstore.transfer_cost import CostModel, LinkEstimate, measure_checksum, measure_link
from contracts.requests import PeerHint, SendBlocksInput
from worker.async_engine import AsyncEngine, CountHeld, ReadBlocks, StageBlocks

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger("kvmesh.peer")

AskPeer = Callable[[str, Sequence[BlockHash], int, int, int], Awaitable[int]]
"""`ask(address, block_hashes, dst_rank, src_rank, transfer_id)` → blocks the peer at
`address` will send; raises PeerUnavailable. (The gRPC call lives in worker/server.py.)"""


class Fetched(NamedTuple):
    """Verified blocks from a peer: `staged` puts them in the host tier (sent with the
    request's AddRequest); they are prompt blocks `num_local .. num_local + num_blocks`."""

    staged: StageBlocks
    num_local: int
    num_blocks: int


class PeerError(Exception):
    """Base of the peer-transfer errors a caller handles."""


class InvalidPeerRequest(PeerError, ValueError):
    """A SendBlocks request this worker cannot serve as sent (gRPC INVALID_ARGUMENT)."""


class PeerTransferOff(PeerError):
    """This worker is in no transfer group (gRPC FAILED_PRECONDITION)."""


class PeerUnavailable(PeerError):
    """The peer's control plane did not answer (down, refused, timed out)."""


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The transfer group to join and how the worker measures itself for the cost model.
    `faults` (tests only): one action per send of this worker, in order — "ok", "corrupt:J"
    (flip a byte of block J after its checksum was taken) or "exit" (end the process before
    the payload goes out: a peer killed mid-transfer)."""

    transfer: TransferConfig
    prefill_probe_tokens: int = 64
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_probe_tokens, int) or self.prefill_probe_tokens < 1:
            raise ValueError(f"prefill_probe_tokens={self.prefill_probe_tokens!r} must be a positive integer")
        for action in self.faults:
            if action not in ("ok", "exit") and not (action.startswith("corrupt:") and action[8:].isdigit()):
                raise ValueError(f"faults: {action!r}; accepted: ok, corrupt:J, exit")


class FaultPlan:
    """The `BlockTransfer` fault hook for `PeerConfig.faults` (runs on the transfer thread)."""

    def __init__(self, actions: Sequence[str]) -> None:
        self._actions = list(actions)
        self._count = 0

    def __call__(self, transfer_id: int, blocks: torch.Tensor) -> None:
        action = self._actions[self._count] if self._count < len(self._actions) else "ok"
        self._count += 1
        if action.startswith("corrupt:") and int(action[8:]) < blocks.shape[2]:
            blocks[0, 1, int(action[8:])].view(torch.uint8).view(-1)[3] ^= 0x10  # layer 0, V
        elif action == "exit":
            log.warning("fault injection: exiting during transfer %d", transfer_id)
            time.sleep(0.5)      # let the peer post its receive: the death is mid-transfer
            os._exit(17)


class Decision(enum.Enum):
    FETCH = "fetch"
    RECOMPUTE = "recompute"          # the cost model found prefill cheaper
    LOCAL = "local"                  # this worker already holds as much as the peer
    NO_PEER = "no_peer"              # no usable hint: unknown or lost rank, or this worker


class FetchPlan(NamedTuple):
    decision: Decision
    hint: PeerHint | None
    block_hashes: tuple[BlockHash, ...]   # the blocks to ask for, right after the local ones
    num_local: int
    fetch_s: float                        # the cost model's estimates for them
    recompute_s: float


@dataclass(slots=True)
class PeerCounters:
    """What happened since start (mutated under the plane's lock; `figures` hands out a copy)."""

    fetch_decisions: int = 0
    recompute_decisions: int = 0
    blocks_fetched: int = 0
    bytes_fetched: int = 0
    blocks_bad: int = 0
    fetch_failures: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    send_failures: int = 0
    fetch_seconds: float = 0.0
    last_decision: str = ""
    last_fetch_estimate_s: float = 0.0
    last_recompute_estimate_s: float = 0.0


class PeerFigures(NamedTuple):
    """What the cost model decides with, and the counters (see proto PeerStats)."""

    rank: int
    world_size: int
    backend: str
    prefill_tokens_per_s: float
    checksum_bytes_s: float
    links: dict[int, LinkEstimate | None]
    lost: dict[int, str]
    counters: PeerCounters


def measure_links(group: TransferGroup, nbytes: int = 8 << 20) -> dict[int, LinkEstimate | None]:
    """The link to every peer (None where the measurement failed). Every rank walks its
    peers in ascending order, so the pairs run in one global order and none waits forever."""
    links: dict[int, LinkEstimate | None] = {}
    for peer in range(group.world_size):
        if peer == group.rank:
            continue
        try:
            links[peer] = measure_link(group, peer, nbytes)
        except RuntimeError as e:
            log.warning("rank %d: measuring the link to rank %d failed: %s", group.rank, peer, e)
            links[peer] = None
    return links


def good_leading_run(arrived_hashes: Sequence[int], ok: Sequence[bool], asked: Sequence[BlockHash]) -> int:
    """How many leading blocks may be used: verified (`ok`) and the ones asked for, in order."""
    k = 0
    while k < min(len(ok), len(asked)) and ok[k] and arrived_hashes[k] == asked[k]:
        k += 1
    return k


class PlanView(NamedTuple):
    """What `plan_fetch` decides with: this worker's place, its measured figures, the block shape."""

    rank: int
    world_size: int
    links: dict[int, LinkEstimate | None]
    lost: dict[int, str]
    prefill_tokens_per_s: float
    checksum_bytes_s: float
    bytes_per_block: int
    block_size: int


def plan_fetch(hashes: Sequence[BlockHash], num_local: int, host_capacity: int,
               hints: Sequence[PeerHint], view: PlanView) -> FetchPlan:
    """Fetch or recompute the prompt blocks after the `num_local` held here? The hint with the
    most blocks among usable peers (another rank of the group, link measured, not lost); at
    most `host_capacity` blocks (what the host tier can stage). Pure arithmetic."""
    usable = [h for h in hints if 0 <= h.rank < view.world_size and h.rank != view.rank
              and view.links.get(h.rank) is not None and h.rank not in view.lost]
    if not usable:
        return FetchPlan(Decision.NO_PEER, None, (), num_local, 0.0, 0.0)
    hint = max(usable, key=lambda h: h.num_blocks)
    want = min(hint.num_blocks, len(hashes), num_local + host_capacity)
    if want <= num_local:
        return FetchPlan(Decision.LOCAL, hint, (), num_local, 0.0, 0.0)
    link = view.links[hint.rank]
    assert link is not None
    cost = CostModel.from_link(link, view.prefill_tokens_per_s, view.checksum_bytes_s)
    extra = want - num_local
    fetch_s = cost.fetch_s(extra, view.bytes_per_block)
    recompute_s = cost.recompute_s(extra * view.block_size)
    decision = Decision.FETCH if fetch_s < recompute_s else Decision.RECOMPUTE
    return FetchPlan(decision, hint, tuple(hashes[num_local:want]), num_local, fetch_s, recompute_s)


class PeerPlane:
    """One worker's side of peer transfer (see the module docstring). Thread-safe counters;
    `fetch` and `serve_send` run on the server's event loop."""

    def __init__(self, engine: Engine, group: TransferGroup, transfer: BlockTransfer,
                 links: dict[int, LinkEstimate | None], prefill_tokens_per_s: float,
                 checksum_bytes_s: float) -> None:
        self.group, self.transfer, self.links = group, transfer, links
        self.prefill_tokens_per_s, self.checksum_bytes_s = prefill_tokens_per_s, checksum_bytes_s
        self.spec = BlockSpec.of(engine.store.kv.kv)
        self.block_size = engine.cfg.block_size
        self.salt = engine.salt
        self.host_num_blocks = engine.store.host_num_blocks   # the staging capacity
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._c = PeerCounters()

    @classmethod
    def start(cls, cfg: PeerConfig, engine: Engine) -> PeerPlane:
        """Measure, attach the staging tier, join the group (blocks until every rank joined).
        Raises TransferError when the rendezvous fails."""
        prefill = engine.measure_prefill(cfg.prefill_probe_tokens)
        checksum = measure_checksum()
        engine.store.ensure_host_tier(engine.layout.blocks_for(engine.max_model_len))
        group = TransferGroup.form(cfg.transfer, engine.device)
        links = measure_links(group)
        transfer = BlockTransfer(group, FaultPlan(cfg.faults) if cfg.faults else None)
        log.info("rank %d of %d: prefill %.0f tokens/s, links %s", group.rank, group.world_size, prefill,
                 {p: None if e is None else f"{e.bandwidth_bytes_s / 1e9:.2f} GB/s {e.latency_s * 1e6:.0f} us"
                  for p, e in links.items()})
        return cls(engine, group, transfer, links, prefill, checksum)

    @property
    def rank(self) -> int:
        return self.group.rank

    def close(self, timeout_s: float = 5.0) -> None:
        self.transfer.close(timeout_s)
        self.group.close()

    # -- the owner: SendBlocks ------------------------------------------------------------
    async def serve_send(self, ae: AsyncEngine, req: SendBlocksInput,
                         still_wanted: Callable[[], bool]) -> tuple[int, int, str]:
        """Queue the send of the leading run of `req.block_hashes` held here; returns
        (num_blocks, num_bytes, reason when fewer than asked). Raises InvalidPeerRequest.
        The copy waits for the engine's current step; if by then `still_wanted()` is False
        (the caller's deadline is near) nothing is sent: a send nobody receives would time
        out and close the pair for good."""
        if req.src_rank != self.rank:
            raise InvalidPeerRequest(f"src_rank: {req.src_rank}, but this worker is rank {self.rank}")
        if not 0 <= req.dst_rank < self.group.world_size or req.dst_rank == self.rank:
            raise InvalidPeerRequest(f"dst_rank: {req.dst_rank} is not another rank of world size "
                                     f"{self.group.world_size}")
        if req.transfer_id > MAX_TRANSFER_ID:
            raise InvalidPeerRequest(f"transfer_id: {req.transfer_id} exceeds {MAX_TRANSFER_ID}")
        lost = self.transfer.lost_peers().get(req.dst_rank)
        if lost is not None:
            return 0, 0, f"rank {req.dst_rank} is lost: {lost}"
        hashes = tuple(BlockHash(h) for h in req.block_hashes)
        held = await ae.run(ReadBlocks(hashes, self.group.device))
        if held.blocks is None:
            return 0, 0, "none of the blocks is held here"
        if not still_wanted():
            return 0, 0, "too late: the caller's deadline is near"
        future = self.transfer.send(req.dst_rank, req.transfer_id, held.blocks, hashes[:held.num_blocks])
        future.add_done_callback(self._sent)
        reason = "" if held.num_blocks == len(hashes) else f"holds the first {held.num_blocks} of {len(hashes)}"
        return held.num_blocks, held.num_blocks * self.spec.bytes_per_block, reason

    def _sent(self, future: Future[SendResult]) -> None:
        with self._lock:
            if future.exception() is not None:
                self._c.send_failures += 1
                log.warning("send failed: %s", future.exception())
            else:
                self._c.blocks_sent += future.result().num_blocks
                self._c.bytes_sent += future.result().num_bytes

    # -- the puller: fetch-or-recompute ---------------------------------------------------
    def view(self) -> PlanView:
        return PlanView(self.rank, self.group.world_size, dict(self.links), self.transfer.lost_peers(),
                        self.prefill_tokens_per_s, self.checksum_bytes_s, self.spec.bytes_per_block,
                        self.block_size)

    async def fetch(self, ae: AsyncEngine, token_ids: Sequence[int], hints: Sequence[PeerHint],
                    ask: AskPeer, cache_salt: str = "") -> Fetched | None:
        """Fetch what the cost model says to; None when nothing usable arrived (or was asked).
        `cache_salt` is the request's (the hashes must be the ones its admission looks up)."""
        bs = self.block_size
        # admission recomputes at least the last prompt token: only blocks before it count
        hashes = block_hashes(list(token_ids[:(len(token_ids) - 1) // bs * bs]), bs, self.salt,
                              cache_salt_root(cache_salt))
        assert self.host_num_blocks > 0, "PeerPlane.start attaches a host tier"
        num_local = await ae.run(CountHeld(tuple(hashes)))
        # stage no more than the host tier holds beside this prompt's own blocks (which may
        # be there too): storing more would push the prompt's head out of its LRU
        plan = plan_fetch(hashes, num_local, max(self.host_num_blocks - num_local, 0), hints, self.view())
        self._record_plan(plan)
        if plan.decision is not Decision.FETCH:
            return None
        assert plan.hint is not None
        t0 = time.perf_counter()
        try:
            stored = await self._pull(plan, plan.hint, ask)
        finally:
            with self._lock:
                self._c.fetch_seconds += time.perf_counter() - t0
        if stored is None:
            return None
        keep, blocks = stored
        return Fetched(StageBlocks(tuple(keep), blocks), plan.num_local, len(keep))

    async def _pull(self, plan: FetchPlan, hint: PeerHint,
                    ask: AskPeer) -> tuple[list[BlockHash], torch.Tensor] | None:
        transfer_id = next(self._ids) % (MAX_TRANSFER_ID + 1)
        try:
            n = await ask(hint.address, plan.block_hashes, self.rank, hint.rank, transfer_id)
        except PeerUnavailable as e:
            return self._failed(f"SendBlocks to {hint.address}: {e}")
        if n <= 0:
            return self._failed(f"rank {hint.rank} sends none of the {len(plan.block_hashes)} blocks")
        # Post the receive at once and never cancel it: a send nobody receives loses the pair.
        future = self.transfer.recv(hint.rank, transfer_id, n, self.spec)
        try:
            got = await asyncio.shield(asyncio.wrap_future(future))
        except TransferError as e:
            return self._failed(str(e))
        k = good_leading_run(got.block_hashes, got.ok, plan.block_hashes)
        with self._lock:
            self._c.blocks_bad += len(got.bad_indices)
            self._c.blocks_fetched += k
            self._c.bytes_fetched += k * self.spec.bytes_per_block
        if k < n:
            log.warning("from rank %d: %d of %d blocks usable (bad: %s); recomputing the rest",
                        hint.rank, k, n, got.bad_indices)
        if k == 0:
            return None
        return list(plan.block_hashes[:k]), got.blocks[:, :, :k]   # [L, 2, k, bs, H, D]

    def _failed(self, why: str) -> None:
        log.warning("fetch failed, recomputing: %s", why)
        with self._lock:
            self._c.fetch_failures += 1
        return None

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A real request computed `num_tokens` prompt tokens before its first token in
        `seconds`: keep the best rate seen (the start-up probe may have run while other
        workers were loading). An optimistic prefill rate makes the model fetch only when
        that is clearly cheaper than recomputing."""
        if num_tokens >= 32 and seconds > 0:
            with self._lock:
                self.prefill_tokens_per_s = max(self.prefill_tokens_per_s, num_tokens / seconds)

    def _record_plan(self, plan: FetchPlan) -> None:
        with self._lock:
            self._c.last_decision = plan.decision.value
            self._c.last_fetch_estimate_s, self._c.last_recompute_estimate_s = plan.fetch_s, plan.recompute_s
            self._c.fetch_decisions += plan.decision is Decision.FETCH
            self._c.recompute_decisions += plan.decision is Decision.RECOMPUTE

    def figures(self) -> PeerFigures:
        with self._lock:
            return PeerFigures(
                self.rank, self.group.world_size, self.group.backend, self.prefill_tokens_per_s,
                self.checksum_bytes_s, dict(self.links), self.transfer.lost_peers(), replace(self._c))
