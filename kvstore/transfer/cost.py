"""The cost model of peer transfer and the measurements it runs on.

`CostModel` decides fetch-or-recompute with figures measured on this host: the link
(`measure_link`: real sends over a `PairGroup`, when the pair forms), the checksum rate
(`measure_checksum`) and the worker's prefill throughput (measured by the worker). The
benchmark helpers compare a `BlockTransfer` with a raw send of the same bytes
(`peer_vs_raw`, used by `kvmesh bench transfer`).

Their messages use tags above every transfer tag (transfers use `TAGS * transfer_id + k`
with `transfer_id <= MAX_TRANSFER_ID`), so a measurement never matches a transfer; two
measurements on one pair must not run at once.
"""
from __future__ import annotations

import math
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvstore.transfer.blocks import BlockSpec, BlockTransfer, ChecksumKernel, block_checksums
from kvstore.transfer.group import PairGroup, PeerId, RendezvousStore, TransferConfig, connect_store

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


def measure_checksum(nbytes: int = 16 << 20, repeats: int = 3, kernel: ChecksumKernel | None = None) -> float:
    """Bytes per second of `block_checksums` on this host (best of `repeats`), with `kernel`
    as the transfers will use it."""
    data = torch.randint(0, 256, (1, 2, 16, nbytes // 32), dtype=torch.uint8)  # [1, 2, n, bytes]
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_checksums(data, 16, kernel)
        best = min(best, time.perf_counter() - t0)
    return data.numel() / best


def _roundtrip(pair: PairGroup, data: torch.Tensor, timer: bool, timeout: float) -> float:
    """The timer sends `data` and waits for a one-byte ack; the other receives and acks."""
    ack = torch.zeros(1, dtype=torch.uint8, device=data.device)
    t0 = time.perf_counter()
    works: tuple[Any, ...]   # the pending works of PairGroup.isend / irecv
    if timer:
        works = (pair.isend(data, _DATA_TAG), pair.irecv(ack, _ACK_TAG))
    else:
        pair.wait(pair.irecv(data, _DATA_TAG), timeout)
        works = (pair.isend(ack, _ACK_TAG),)
    for w in works:
        pair.wait(w, timeout)
    return time.perf_counter() - t0


def _share(pair: PairGroup, values: list[float], timer: bool, timeout: float) -> list[float]:
    """The timer's figures, on both members."""
    buf = torch.tensor(values, dtype=torch.float64)
    op = pair.isend if timer else pair.irecv
    pair.wait(op(buf, _FIGURES_TAG), timeout)
    return buf.tolist()


def measure_link(pair: PairGroup, nbytes: int = 8 << 20, repeats: int = 3, timeout_s: float = 10.0) -> LinkEstimate:
    """Time real sends of 64 bytes and of `nbytes` (best of `4 * repeats` and `repeats`
    round trips, each a send and a one-byte ack). RuntimeError if the peer fails.

    Both members call it at the same time and get the same estimate (member 0 times)."""
    timer = pair.local_rank == 0
    small = 64
    device = torch.device("cpu") if pair.backend == "gloo" else pair.device
    best = []
    for size, count in ((small, 4 * repeats), (nbytes, repeats)):  # small ones are cheap and noisy
        data = torch.zeros(size, dtype=torch.uint8, device=device)
        best.append(min(_roundtrip(pair, data, timer, timeout_s) for _ in range(count)))
    latency = best[0] / 2
    bandwidth = (nbytes - small) / max(best[1] - best[0], 1e-9)
    return LinkEstimate(*_share(pair, [bandwidth, latency], timer, timeout_s))


def _timed(pair: PairGroup, receiver: bool, once: Callable[[], None], timeout: float) -> float:
    """Seconds of `once()` on the receiver, started by a go token it sends so both sides
    start together (the sender runs `once()` on receipt; its figure means nothing)."""
    go = torch.zeros(1, dtype=torch.uint8)
    t0 = time.perf_counter()
    pair.wait((pair.isend if receiver else pair.irecv)(go, _GO_TAG), timeout)
    once()
    return time.perf_counter() - t0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)   # every thread: gloo's I/O threads and their syscalls too
    return r.ru_utime + r.ru_stime


def _timed_cpu(pair: PairGroup, receiver: bool, once: Callable[[], None], timeout: float) -> tuple[float, float]:
    """`_timed`, and this process's CPU seconds over it (after a short settle: the
    transfer's threads may still be finishing when `once` returns on the other side)."""
    c0 = _cpu_s()
    wall = _timed(pair, receiver, once, timeout)
    time.sleep(0.005)
    return wall, _cpu_s() - c0


class PeerPhases(NamedTuple):
    """Where a staging transfer's time goes (medians, seconds from the receiver's `recv`):
    the first and the last piece in, the receiver's and the sender's hashing (overlapping
    the wire, but for the receiver's last piece), and the end."""

    first_piece_s: float
    last_piece_s: float
    recv_hashing_s: float
    send_hashing_s: float
    total_s: float


class PeerVsRaw(NamedTuple):
    """`peer_bytes_s`: blocks received into a reused staging buffer (as a worker does);
    `peer_alloc_bytes_s`: into a fresh tensor each time; raw: one preallocated buffer.
    `*_cpu_s`: CPU seconds (user + system, every thread, both processes) of one staging
    transfer and of one raw send: on a shared box they move less with the load than wall time."""

    num_blocks: int
    num_bytes: int
    peer_bytes_s: float
    peer_alloc_bytes_s: float
    raw_bytes_s: float
    ratio: float  # peer_bytes_s / raw_bytes_s; the benchmark target is >= 0.7
    link: LinkEstimate
    peer_cpu_s: float
    raw_cpu_s: float
    phases: PeerPhases


_BENCH_KEY = "bench"


KernelLoader = Callable[[], ChecksumKernel | None]


def _bench_sender(address: str, spec: BlockSpec, num_blocks: int, repeats: int, timeout_s: float,
                  kernel_loader: KernelLoader | None) -> None:
    cfg = TransferConfig(timeout_s=timeout_s, connect_timeout_s=timeout_s)
    pair = PairGroup.form(_BENCH_KEY, connect_store(address, timeout_s), 1, PeerId("bench-receiver", 0), "cpu", cfg)
    _bench_pair(pair, spec, num_blocks, repeats, timeout_s, None if kernel_loader is None else kernel_loader())


def _bench_pair(pair: PairGroup, spec: BlockSpec, num_blocks: int, repeats: int, timeout: float,
                kernel: ChecksumKernel | None) -> PeerVsRaw:
    """Raw send, transfer into a staging buffer, transfer into a fresh tensor: one of each
    per round (so load drifting on a shared box hits all three alike), medians reported."""
    receiver, nbytes = pair.local_rank == 0, num_blocks * spec.bytes_per_block
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(spec.dtype)
    data = data.view(spec.shape(num_blocks))  # [L, 2, n, bs, H, D]: sent, or the staging buffer
    raw_buf = torch.zeros(nbytes, dtype=torch.uint8)
    hashes = list(range(num_blocks))
    transfer = BlockTransfer(timeout, checksum_kernel=kernel)

    def raw() -> None:
        pair.wait((pair.irecv if receiver else pair.isend)(raw_buf, _DATA_TAG), timeout)

    staged: list[list[float]] = []  # per staging round: this side's phase figures

    def ours(transfer_id: int, staging: bool) -> Callable[[], None]:
        def once() -> None:
            if receiver:
                got = transfer.recv(pair, transfer_id, num_blocks, spec, data if staging else None).result()
                assert got.times is not None and all(got.ok), "a benchmark transfer failed its checksums"
                figures = [got.times.first_piece_s, got.times.last_piece_s, got.times.hashing_s, got.times.total_s]
            else:
                figures = [transfer.send(pair, transfer_id, data, hashes).result().hashing_s]
            if staging:
                staged.append(figures)
        return once
    try:
        link = measure_link(pair, timeout_s=timeout)
        rounds = [[_timed_cpu(pair, receiver, f, timeout) for f in (raw, ours(2 * i, True), ours(2 * i + 1, False))]
                  for i in range(repeats + 1)][1:]  # round 0 warms up
        cpu = [statistics.median(r[k][1] for r in rounds) for k in range(2)]   # raw, staging
        mine = cpu + [statistics.median(f[0] for f in staged[1:])]             # (the sender's: its hashing)
        other = _share(pair, mine, not receiver, timeout)                      # the sender's, to the receiver
        phases = [statistics.median(f[k] for f in staged[1:]) for k in range(len(staged[0]))]
        figures = _share(pair, [statistics.median(r[k][0] for r in rounds) for k in range(3)]
                         + [cpu[0] + other[0], cpu[1] + other[1]] + phases[:3] + [other[2]] + phases[3:4],
                         receiver, timeout) if receiver else _share(pair, [0.0] * 10, receiver, timeout)
    finally:
        transfer.close()
        pair.close()
    raw_s, ours_s, alloc_s, raw_cpu, ours_cpu = figures[:5]
    return PeerVsRaw(num_blocks, nbytes, nbytes / ours_s, nbytes / alloc_s, nbytes / raw_s, raw_s / ours_s, link,
                     ours_cpu, raw_cpu, PeerPhases(*figures[5:]))


def peer_vs_raw(spec: BlockSpec, num_blocks: int, repeats: int = 5, timeout_s: float = 30.0,
                kernel_loader: KernelLoader | None = None) -> PeerVsRaw:
    """Peer transfer of `num_blocks` blocks vs one raw gloo send of the same bytes, between
    this process (the receiver, hosting the pair's store) and a spawned one over loopback.
    `kernel_loader` (a module-level function: the spawned process calls it too) gives the
    checksum kernel both sides use, as a worker's `BlockTransfer` does."""
    store = RendezvousStore("127.0.0.1", 0, timeout_s)
    child = multiprocessing.get_context("spawn").Process(
        target=_bench_sender, args=(store.address(), spec, num_blocks, repeats, timeout_s, kernel_loader), daemon=True)
    child.start()
    try:
        cfg = TransferConfig(timeout_s=timeout_s, connect_timeout_s=timeout_s)
        pair = PairGroup.form(_BENCH_KEY, store.store, 0, PeerId("bench-sender", 0), "cpu", cfg)
        return _bench_pair(pair, spec, num_blocks, repeats, timeout_s,
                           None if kernel_loader is None else kernel_loader())
    finally:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
