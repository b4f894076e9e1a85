"""The cost model of peer transfer and the measurements it runs on.

`CostModel` decides fetch-or-recompute with figures measured on this host: the link
(`measure_link`: real sends over a `TransferGroup` pair), the checksum rate
(`measure_checksum`) and the worker's prefill throughput (measured by the worker). The
benchmark helpers compare a `BlockTransfer` with a raw send of the same bytes
(`raw_send_throughput`, `peer_vs_raw`, used by `kvmesh bench transfer`).

Their messages use tags above every transfer tag (transfers use `3 * transfer_id + 0..2`
with `transfer_id <= MAX_TRANSFER_ID`), so a measurement never matches a transfer; two
measurements on one pair must not run at once.
"""
from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstore.transfer import BlockSpec, BlockTransfer, block_checksums
from kvstore.transfer_group import TransferConfig, TransferGroup, free_port

_GO_TAG, _DATA_TAG, _ACK_TAG, _FIGURES_TAG = ((1 << 31) - 1 - i for i in range(4))  # above transfer tags


class LinkEstimate(NamedTuple):
    """One link measured with real sends: time(nbytes) ~= latency_s + nbytes / bandwidth."""

    bandwidth_bytes_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Fetch a prefix from a peer, or recompute it? Pure arithmetic on measured figures.

    A fetch costs one latency plus, per byte, the wire time and the receiver's checksum
    (the sender hashes while its payload is on the wire; verifying waits for all of it)."""

    bandwidth_bytes_s: float
    latency_s: float
    prefill_tokens_per_s: float
    checksum_bytes_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_s", "prefill_tokens_per_s", "checksum_bytes_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s={self.latency_s!r} must be >= 0")

    @classmethod
    def from_link(cls, link: LinkEstimate, prefill_tokens_per_s: float,
                  checksum_bytes_s: float = math.inf) -> CostModel:
        return cls(link.bandwidth_bytes_s, link.latency_s, prefill_tokens_per_s, checksum_bytes_s)

    def fetch_s(self, num_blocks: int, bytes_per_block: int) -> float:
        nbytes = num_blocks * bytes_per_block
        return self.latency_s + nbytes / self.bandwidth_bytes_s + nbytes / self.checksum_bytes_s

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def should_fetch(self, num_blocks: int, bytes_per_block: int, block_size: int) -> bool:
        """True when fetching `num_blocks` full blocks beats prefilling their tokens."""
        if num_blocks <= 0:
            return False
        return self.fetch_s(num_blocks, bytes_per_block) < self.recompute_s(num_blocks * block_size)


def measure_checksum(nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Bytes per second of `block_checksums` on this host (best of `repeats`)."""
    data = torch.randint(0, 256, (1, 2, 16, nbytes // 32), dtype=torch.uint8)  # [1, 2, n, bytes]
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_checksums(data, 16)
        best = min(best, time.perf_counter() - t0)
    return data.numel() / best


def _roundtrip(group: TransferGroup, peer: int, data: torch.Tensor, timer: bool) -> float:
    """The timer sends `data` and waits for a one-byte ack; the other receives and acks."""
    ack, timeout = torch.zeros(1, dtype=torch.uint8), group.config.timeout_s
    t0 = time.perf_counter()
    if timer:
        works = (group.isend(data, peer, _DATA_TAG), group.irecv(ack, peer, _ACK_TAG))
    else:
        group.wait(group.irecv(data, peer, _DATA_TAG), timeout)
        works = (group.isend(ack, peer, _ACK_TAG),)
    for w in works:
        group.wait(w, timeout)
    return time.perf_counter() - t0


def _share(group: TransferGroup, peer: int, values: list[float], timer: bool) -> list[float]:
    """The timer's figures, on both ranks."""
    buf = torch.tensor(values, dtype=torch.float64)
    op = group.isend if timer else group.irecv
    group.wait(op(buf, peer, _FIGURES_TAG), group.config.timeout_s)
    return buf.tolist()


def measure_link(group: TransferGroup, peer: int, nbytes: int = 8 << 20, repeats: int = 3) -> LinkEstimate:
    """Time real sends of 64 bytes and of `nbytes` (best of `4 * repeats` and `repeats`
    round trips, each a send and a one-byte ack).

    Both ranks call it at the same time and get the same estimate (the lower rank times)."""
    timer = group.rank < peer
    small = 64
    best = []
    for size, count in ((small, 4 * repeats), (nbytes, repeats)):  # small ones are cheap and noisy
        data = torch.zeros(size, dtype=torch.uint8, device=group.device)
        best.append(min(_roundtrip(group, peer, data, timer) for _ in range(count)))
    latency = best[0] / 2
    bandwidth = (nbytes - small) / max(best[1] - best[0], 1e-9)
    return LinkEstimate(*_share(group, peer, [bandwidth, latency], timer))


def _timed(group: TransferGroup, peer: int, receiver: bool, once: Callable[[], None]) -> float:
    """Seconds of `once()` on the receiver, started by a go token it sends so both sides
    start together (the sender runs `once()` on receipt; its figure means nothing)."""
    go = torch.zeros(1, dtype=torch.uint8)
    t0 = time.perf_counter()
    group.wait((group.isend if receiver else group.irecv)(go, peer, _GO_TAG), group.config.timeout_s)
    once()
    return time.perf_counter() - t0


def raw_send_throughput(group: TransferGroup, peer: int, nbytes: int, repeats: int,
                        receiver: bool) -> float:
    """Bytes/s of one plain send of an `nbytes` tensor into a preallocated buffer (median of
    `repeats`). Both ranks call it; both get the receiver's figure."""
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=group.device)
    op = group.irecv if receiver else group.isend

    def once() -> None:
        group.wait(op(buf, peer, _DATA_TAG), group.config.timeout_s)
    median = statistics.median(_timed(group, peer, receiver, once) for _ in range(repeats))
    return nbytes / _share(group, peer, [median], receiver)[0]


class PeerVsRaw(NamedTuple):
    """`peer_bytes_s`: blocks received into a reused staging buffer (as a worker does);
    `peer_alloc_bytes_s`: into a fresh tensor each time; raw: one preallocated buffer."""

    num_blocks: int
    num_bytes: int
    peer_bytes_s: float
    peer_alloc_bytes_s: float
    raw_bytes_s: float
    ratio: float  # peer_bytes_s / raw_bytes_s; the benchmark target is >= 0.5
    link: LinkEstimate


def _bench_sender(port: int, spec: BlockSpec, num_blocks: int, repeats: int, timeout_s: float) -> None:
    group = TransferGroup.form(TransferConfig(rank=1, world_size=2, master_port=port, timeout_s=timeout_s))
    _bench_pair(group, spec, num_blocks, repeats, receiver=False)


def _bench_pair(group: TransferGroup, spec: BlockSpec, num_blocks: int, repeats: int,
                receiver: bool) -> PeerVsRaw:
    """Raw send, transfer into a staging buffer, transfer into a fresh tensor: one of each
    per round (so load drifting on a shared box hits all three alike), medians reported."""
    peer, nbytes, timeout = 1 - group.rank, num_blocks * spec.bytes_per_block, group.config.timeout_s
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(spec.dtype)
    data = data.view(spec.shape(num_blocks))  # [L, 2, n, bs, H, D]: sent, or the staging buffer
    raw_buf = torch.zeros(nbytes, dtype=torch.uint8)
    hashes = list(range(num_blocks))
    transfer = BlockTransfer(group)

    def raw() -> None:
        group.wait((group.irecv if receiver else group.isend)(raw_buf, peer, _DATA_TAG), timeout)

    def ours(transfer_id: int, staging: bool) -> Callable[[], None]:
        def once() -> None:
            future = transfer.recv(peer, transfer_id, num_blocks, spec, data if staging else None) \
                if receiver else transfer.send(peer, transfer_id, data, hashes)
            future.result()
        return once
    try:
        link = measure_link(group, peer)
        rounds = [[_timed(group, peer, receiver, f) for f in (raw, ours(2 * i, True), ours(2 * i + 1, False))]
                  for i in range(repeats + 1)][1:]  # round 0 warms up
        raw_s, ours_s, alloc_s = _share(group, peer, [statistics.median(r[k] for r in rounds)
                                                      for k in range(3)], receiver)
    finally:
        transfer.close()
        group.close()
    return PeerVsRaw(num_blocks, nbytes, nbytes / ours_s, nbytes / alloc_s, nbytes / raw_s, raw_s / ours_s, link)


def peer_vs_raw(spec: BlockSpec, num_blocks: int, repeats: int = 5, timeout_s: float = 30.0) -> PeerVsRaw:
    """Peer transfer of `num_blocks` blocks vs one raw gloo send of the same bytes, between
    this process (rank 0, the receiver) and a spawned one (rank 1) over loopback."""
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(
        target=_bench_sender, args=(port, spec, num_blocks, repeats, timeout_s), daemon=True)
    child.start()
    try:
        group = TransferGroup.form(TransferConfig(rank=0, world_size=2, master_port=port, timeout_s=timeout_s))
        return _bench_pair(group, spec, num_blocks, repeats, receiver=True)
    finally:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
