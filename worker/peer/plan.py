"""Fetch or recompute: the pure decision of the peer plane (`worker.peer.plane`), and its
test-only fault plan.

`plan_fetch` weighs fetching the prompt blocks a peer holds against prefilling them, with
the link to that peer as measured when the last pair with it formed (`ASSUMED_LINK` before
any did) and this worker's measured prefill and checksum rates.
"""
from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from contracts.requests import PeerHint
from kvstore.keys import BlockHash
from kvstore.transfer.cost import CostModel, LinkEstimate

log = logging.getLogger("kvmesh.peer")

ASSUMED_LINK = LinkEstimate(bandwidth_bytes_s=1e9, latency_s=1e-3)
"""The cost model's link to a peer no pair has measured yet (replaced once a pair forms)."""


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
    NO_PEER = "no_peer"              # no usable hint (none, or only this worker)


class FetchPlan(NamedTuple):
    decision: Decision
    hint: PeerHint | None
    block_hashes: tuple[BlockHash, ...]   # the blocks to ask for, right after the local ones
    num_local: int
    fetch_s: float                        # the cost model's estimates for them
    recompute_s: float


def good_leading_run(arrived_hashes: Sequence[int], ok: Sequence[bool], asked: Sequence[BlockHash]) -> int:
    """How many leading blocks may be used: verified (`ok`) and the ones asked for, in order."""
    k = 0
    while k < min(len(ok), len(asked)) and ok[k] and arrived_hashes[k] == asked[k]:
        k += 1
    return k


class PlanView(NamedTuple):
    """What `plan_fetch` decides with: this worker's id, its measured figures, the block shape."""

    worker_id: str
    links: dict[str, LinkEstimate]
    prefill_tokens_per_s: float
    checksum_bytes_s: float
    bytes_per_block: int
    block_size: int


def plan_fetch(hashes: Sequence[BlockHash], num_local: int, host_capacity: int,
               hints: Sequence[PeerHint], view: PlanView, force: bool = False) -> FetchPlan:
    """Fetch or recompute the prompt blocks after the `num_local` held here? The hint with the
    most blocks among other workers; at most `host_capacity` blocks (what the host tier can
    stage); the peer's measured link, else `ASSUMED_LINK`; `force` fetches whatever the cost
    model says (a hand-off: the peer computed them for this request). Pure arithmetic."""
    usable = [h for h in hints if h.worker_id and h.worker_id != view.worker_id]
    if not usable:
        return FetchPlan(Decision.NO_PEER, None, (), num_local, 0.0, 0.0)
    hint = max(usable, key=lambda h: h.num_blocks)
    want = min(hint.num_blocks, len(hashes), num_local + host_capacity)
    if want <= num_local:
        return FetchPlan(Decision.LOCAL, hint, (), num_local, 0.0, 0.0)
    link = view.links.get(hint.worker_id, ASSUMED_LINK)
    cost = CostModel.from_link(link, view.prefill_tokens_per_s, view.checksum_bytes_s)
    extra = want - num_local
    fetch_s = cost.fetch_s(extra, view.bytes_per_block)
    recompute_s = cost.recompute_s(extra * view.block_size)
    decision = Decision.FETCH if force or fetch_s < recompute_s else Decision.RECOMPUTE
    return FetchPlan(decision, hint, tuple(hashes[num_local:want]), num_local, fetch_s, recompute_s)
