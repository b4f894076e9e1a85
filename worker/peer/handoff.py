"""The decode worker's side of a disaggregated hand-off (router/routing/disagg.py): fetch the
prompt's blocks from the prefill worker that is computing them, in rounds, as it stores them.

The router sends the request here once the prefill worker reported its first prefill chunk,
so the prefill worker is still computing the rest when the first round asks. Each round asks
(`SendBlocks`, on the same authenticated channel and pair as any peer fetch) for the blocks
not fetched yet; the prefill worker sends the leading run of them it holds — the chunks
finished so far — checksummed, and the round receives and verifies them (on the transfer's
threads, off the engine thread). A round that finds no new block held waits and asks again,
the wait doubling from `poll_s` up to `MAX_POLL_S` while none comes (a prefill chunk runs for
a second or more on a CPU core, and every round costs the decode worker's core a gRPC call)
and back to `poll_s` once one came. The transfer of chunk k thus overlaps the computation of
chunk k + 1, and only the last chunk's blocks move after the prefill ends.

The decode worker is streaming other requests all the while, so what arrives is put into its
host tier as it arrives, `STAGE_BLOCKS` blocks per engine command (`StageBlocks`, between two
steps; the next piece is sent once the last one is in, so pieces land between different
steps): no step waits behind one copy of the whole prompt, and admission finds the blocks
there (it onloads them like any host hit).

Bounds: on progress — no more than the hint's `timeout_s` (the router's
`--disagg-transfer-timeout-s`) without a new block, so a long prefill takes what it takes and a
stalled one costs the bound after its last block; at most the host tier's staging room
(`plan_fetch`). Ends when every planned block arrived, when no block came in time, or at the
first failed round (the prefill worker unreachable, a broken transfer, a bad checksum): the
verified leading run of what arrived is staged, the request is admitted with it and the decode
worker computes the rest, so the tokens are the same whatever arrived. A prefill worker that finished
before the first round makes this one round: the sequential hand-off.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import torch

from contracts.requests import PeerHint
from kvstore.keys import BlockHash, block_hashes, cache_salt_root
from worker.engine.async_engine import AsyncEngine, StageBlocks
from worker.peer.config import AskPeer, Fetched
from worker.peer.errors import FetchCause, FetchFailure
from worker.peer.plan import Decision, FetchPlan, plan_fetch
from worker.peer.plane import PeerPlane

POLL_S = 0.02       # the first wait after a round that found no new block held (a prefill chunk is running)
MAX_POLL_S = 0.16   # the longest such wait: what the last chunk's blocks may wait past the end of the prefill
STAGE_BLOCKS = 8    # blocks per StageBlocks command (~6 MB of fp32 KV of the default model: a few ms)


async def fetch_streamed(plane: PeerPlane, ae: AsyncEngine, token_ids: Sequence[int], hint: PeerHint,
                         ask: AskPeer, cache_salt: str = "",
                         on_failed: Callable[[FetchFailure], None] | None = None,
                         poll_s: float = POLL_S) -> Fetched | None:
    """The prompt blocks `hint`'s worker computes for this request, fetched in rounds within
    `hint.timeout_s` of each other and staged into the host tier as they arrive (see the module
    docstring); None when nothing usable arrived, else a `Fetched` whose `staged` is None (the
    blocks are in the host tier already). `on_failed` hears why the rounds ended short (one
    failure, TIMEOUT when no block came in time)."""
    deadline = time.monotonic() + hint.timeout_s
    bs = plane.block_size
    # admission recomputes at least the last prompt token: only blocks before it count
    hashes = block_hashes(list(token_ids[:(len(token_ids) - 1) // bs * bs]), bs, plane.salt,
                          cache_salt_root(cache_salt))
    num_local = ae.count_held(hashes)
    plan = plan_fetch(hashes, num_local, max(plane.host_num_blocks - num_local, 0), (hint,), plane.view(), True)
    plane.record_plan(plan)
    if plan.decision is not Decision.FETCH:
        return None
    t0 = time.perf_counter()
    got: list[BlockHash] = []
    failure: FetchFailure | None = None
    wait_s = poll_s
    try:
        while len(got) < len(plan.block_hashes):
            left = deadline - time.monotonic()
            if left <= 0:
                failure = FetchFailure(FetchCause.TIMEOUT, f"{len(got)} of {len(plan.block_hashes)} blocks from "
                                                           f"{hint.worker_id}, none new in {hint.timeout_s:.1f} s")
                break
            rest = plan._replace(block_hashes=plan.block_hashes[len(got):])
            try:
                result = await asyncio.wait_for(_round(plane, rest, hint, ask), left)
            except TimeoutError:
                continue                  # the deadline: counted above
            if result is None:            # nothing new held yet: the prefill worker's chunk is running
                await asyncio.sleep(min(wait_s, max(deadline - time.monotonic(), 0.0)))
                wait_s = min(2 * wait_s, max(poll_s, MAX_POLL_S))
                continue
            if isinstance(result, FetchFailure):
                failure = result
                break
            keep, blocks, asked = result
            await stage_in_pieces(ae, keep, blocks)
            got.extend(keep)
            if keep:                      # progress: the bound runs again from here
                deadline = time.monotonic() + hint.timeout_s
                wait_s = poll_s
            if len(keep) < asked:         # a bad block: keep the good run before it, compute the rest
                failure = FetchFailure(FetchCause.BAD_CHECKSUM, f"block {len(got)} from {hint.worker_id} "
                                                                "failed its check")
                break
    finally:
        plane.observe_fetch(time.perf_counter() - t0)
    if failure is not None:
        if failure.cause is FetchCause.TIMEOUT:    # the others: counted where they happened
            plane.failed(failure)
        if on_failed is not None:
            on_failed(failure)
    if not got:
        return None
    return Fetched(None, plan.num_local, len(got))


async def stage_in_pieces(ae: AsyncEngine, block_hashes: Sequence[BlockHash], blocks: torch.Tensor,
                          piece_blocks: int = STAGE_BLOCKS) -> None:
    """Put verified `blocks` ([L, 2, k, bs, H, D], k = len(block_hashes)) into the host tier,
    `piece_blocks` per engine command, each sent once the one before was applied."""
    for i in range(0, len(block_hashes), piece_blocks):
        await ae.run(StageBlocks(tuple(block_hashes[i:i + piece_blocks]), blocks[:, :, i:i + piece_blocks]))


async def _round(plane: PeerPlane, plan: FetchPlan, hint: PeerHint,
                 ask: AskPeer) -> tuple[list[BlockHash], torch.Tensor, int] | FetchFailure | None:
    """One round: the verified leading run of what the peer holds of `plan.block_hashes` now
    and how many blocks it sent; None when it holds none of them yet."""
    transfer_id = plane.next_transfer_id()
    asked = await plane.ask_for(hint, plan, transfer_id, ask)
    if isinstance(asked, FetchFailure):
        return None if asked.cause is FetchCause.NOT_HELD else plane.failed(asked)
    pair, n = asked
    received = await plane.receive(plan, pair, transfer_id, n)
    return received if isinstance(received, FetchFailure) else (*received, n)
