"""Peer-to-peer KV block transfer over torch.distributed (gloo on CPU, NCCL on GPU).

A worker forms one `TransferGroup` at start (rank and world size from the launcher) and
owns one `BlockTransfer`. The peer plane (`worker.peer`, on the server's event loop) calls
`send` / `recv` and gets a Future; the transfer's own threads wait for the network, so
neither the event loop nor the engine thread ever blocks on it (the engine thread only
copies blocks out, `KVStore.read`, and stages arriving ones, `KVStore.stage`). Blocks
travel as gathered by `KVTensors.gather_blocks`:
`[num_layers, 2, n, block_size, H, D | slot_bytes]`, so quantized pools move plain bytes.
The cost model (fetch or recompute?) and the link measurements: `kvstore.transfer_cost`.

Wire, per transfer, in this order (tags `3 * transfer_id + 0 | 2 | 1`: transfers never cross):
  preamble  int64[4]   MAGIC, transfer_id, num_blocks, payload bytes
  payload   uint8[..]  the contiguous gathered tensor, viewed as bytes
  body      int64[3n]  xxh3_64 of each block's bytes, block hash high / low 64 bits
The sender posts the payload before hashing it, so its checksums overlap the wire time.
A block whose checksum does not match on arrival is marked bad in `ReceivedBlocks.ok`
(the caller recomputes it); only a lost peer, a timeout or a protocol mismatch fails the
whole transfer, with `TransferError`.

The checksum is xxh3_64 rather than crc32: in a throwaway timing on the dev box crc32 hashed
several times slower than xxh3 and slower than gloo loopback moves bytes, so with crc32 on
both ends a transfer could not keep up with a raw send (`kvmesh bench transfer` reports the
ratio that matters, `peer_vs_raw`). The hashing releases the GIL (the loop over blocks and
planes around it does not).

What gloo (torch 2.13) does on failure, found by experiment, and what this module does:
- A peer process that dies: every pending and later op with it fails at once with
  "Connection closed by peer" (no wait for a timeout); pairs with other ranks keep working.
  -> `TransferError` within milliseconds, and the peer is marked lost.
- A peer that is alive but never sends: `work.wait(timeout)` raises after the timeout and
  gloo closes EVERY pair of that process group ("Application timeout caused pair closure"),
  on both sides, for good. Gloo can neither cancel a receive nor poll one
  (`is_completed()` stays False for send/recv work, `get_future()` is not implemented).
  Hence one two-rank group per peer pair (`TransferGroup`): a timeout loses only that
  peer, whom re-forming the pair would bring back (not done here).
- A message larger than the posted receive buffer makes gloo's I/O thread throw and the
  receiving process terminate (std::terminate). Hence the fixed-size preamble: the
  receiver checks the announced size before posting the body and payload receives; a
  mismatch fails that transfer (and loses the pair when the sender times out) but never
  kills the process.
- Sends rendezvous: a send completes only after the receiver posted the matching receive
  (and a send nobody receives times out, losing the pair). So the control plane must ask a
  peer to send only when this side will receive.
Because `wait` is the only completion signal, one thread posts every op in request order
(never waiting) and waiter threads, one for sends to and one for receives from each peer,
complete them: a slow peer stalls only its own transfers, and two workers pulling from
each other cannot deadlock.

"""
from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import xxhash

from kvstore.keys import BlockHash
from kvstore.transfer_group import TransferError, TransferGroup

MAX_TRANSFER_ID = (1 << 29) - 1  # gloo tags are C ints; 3 tags per transfer
_MAGIC = 0x6B766D657368  # "kvmesh"
_U64 = 1 << 64
_BLOCK_DIM = 2

FaultHook = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One block on the wire: `[num_layers, 2, block_size, H, last_dim]` of `dtype`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    last_dim: int  # head_dim, or slot_bytes for a quantized pool
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "last_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")

    @classmethod
    def of(cls, kv: torch.Tensor) -> BlockSpec:
        """The spec of a pool's `kv` tensor or of gathered blocks `[L, 2, n, bs, H, D]`."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"kv.shape={tuple(kv.shape)}; expected [L, 2, n, block_size, H, D]")
        num_layers, _, _, block_size, num_kv_heads, last_dim = kv.shape
        return cls(num_layers, block_size, num_kv_heads, last_dim, kv.dtype)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.last_dim)

    @property
    def chunk_bytes(self) -> int:
        """Contiguous bytes of one block in one (layer, K|V) plane."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.last_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.chunk_bytes


class ReceivedBlocks(NamedTuple):
    """What arrived: `blocks` `[L, 2, n, bs, H, D]` (owned by the caller), their hashes, and
    `ok[j]` False where block j failed its checksum (its bytes must not be used)."""

    blocks: torch.Tensor
    block_hashes: tuple[BlockHash, ...]
    ok: tuple[bool, ...]

    @property
    def bad_indices(self) -> list[int]:
        return [j for j, good in enumerate(self.ok) if not good]


class SendResult(NamedTuple):
    """A completed send: the peer holds the bytes (not yet verified them)."""

    num_blocks: int
    num_bytes: int
    seconds: float


def block_checksums(payload: torch.Tensor, num_blocks: int) -> list[int]:
    """xxh3_64 of each block's bytes in a contiguous `[L, 2, n, ...]` payload (host memory).

    Block j's bytes are the j-th chunk of each of the 2L (layer, K|V) planes."""
    assert payload.is_contiguous() and payload.device.type == "cpu" and payload.numel() > 0
    nbytes = payload.numel() * payload.element_size()
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(payload.data_ptr())).cast("B")
    chunk = nbytes // num_blocks // (payload.shape[0] * 2)
    sums = []
    for j in range(num_blocks):
        h = xxhash.xxh3_64()
        for plane in range(payload.shape[0] * 2):
            start = (plane * num_blocks + j) * chunk
            h.update(view[start:start + chunk])
        sums.append(h.intdigest())
    return sums


def _i64(u: int) -> int:
    return u - _U64 if u >= 1 << 63 else u


def _u64(i: int) -> int:
    return i + _U64 if i < 0 else i


def _encode_body(checksums: Sequence[int], hashes: Sequence[int]) -> torch.Tensor:
    values = [_i64(c) for c in checksums] + [_i64(h >> 64) for h in hashes] \
        + [_i64(h & (_U64 - 1)) for h in hashes]
    return torch.tensor(values, dtype=torch.int64)  # [3n]


def _decode_body(body: torch.Tensor, n: int) -> tuple[list[int], list[BlockHash]]:
    vals = [_u64(v) for v in body.tolist()]
    return vals[:n], [BlockHash((hi << 64) | lo) for hi, lo in zip(vals[n:2 * n], vals[2 * n:])]


@dataclass(slots=True)
class _Op:
    """One queued transfer; `works` are its posted ops, completed by its peer's waiter."""

    is_send: bool
    peer: int
    transfer_id: int
    num_blocks: int
    deadline: float
    future: Future[Any]
    spec: BlockSpec | None = None
    blocks: torch.Tensor | None = None
    hashes: Sequence[int] = ()
    works: tuple[Any, ...] = ()
    bufs: tuple[torch.Tensor, ...] = ()
    start: float = 0.0


class BlockTransfer:
    """The transfer engine of one worker: queued sends and receives run off the caller's
    thread. Futures fail with `TransferError` only; `close()` stops the threads."""

    def __init__(self, group: TransferGroup, fault_hook: FaultHook | None = None) -> None:
        """`fault_hook(transfer_id, blocks)` (tests only) runs on the sender after the
        checksums are taken and before the bytes go out, e.g. to corrupt a block."""
        self.group = group
        self._fault_hook = fault_hook
        self._timeout_s = group.config.timeout_s
        self._post_all = group.backend != "gloo"  # NCCL matches by order: post all at once
        self._requests: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._waiters: dict[tuple[int, bool], queue.SimpleQueue[_Op | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lost: dict[int, str] = {}  # peer -> why (gloo closed the pair; never reopens)
        self._lock = threading.Lock()
        self._closed = False
        self._start_thread(self._post_loop, "kvmesh-transfer")

    def send(self, dst_rank: int, transfer_id: int, blocks: torch.Tensor,
             block_hashes: Sequence[int]) -> Future[SendResult]:
        """Send gathered `blocks` `[L, 2, n, bs, H, D]`; do not modify them until the future
        is done. The peer must call `recv` with the same transfer_id and n."""
        spec = BlockSpec.of(blocks)
        n = blocks.shape[_BLOCK_DIM]
        if len(block_hashes) != n:
            raise ValueError(f"len(block_hashes)={len(block_hashes)} != num_blocks={n}")
        if bad := [h for h in block_hashes if not 0 <= h < 1 << 128]:
            raise ValueError(f"block_hashes has values outside [0, 2**128): {bad[:4]}")
        if blocks.device != self.group.device:
            raise ValueError(f"blocks are on {blocks.device}; the group sends from {self.group.device}")
        op = self._new_op(True, dst_rank, transfer_id, n)
        op.spec, op.blocks, op.hashes = spec, blocks.contiguous(), block_hashes
        return self._submit(op)

    def recv(self, src_rank: int, transfer_id: int, num_blocks: int, spec: BlockSpec,
             out: torch.Tensor | None = None) -> Future[ReceivedBlocks]:
        """Receive `num_blocks` blocks shaped by `spec`, into `out` (contiguous, on the group
        device, `spec.shape(num_blocks)`; not to be touched until the future is done) or
        into a new tensor. A reused `out` staging buffer saves the page faults of a fresh
        allocation, which on the dev box cost as much as the transfer itself."""
        if out is not None and (tuple(out.shape) != spec.shape(num_blocks) or out.dtype != spec.dtype
                                or not out.is_contiguous() or out.device != self.group.device):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected a "
                             f"contiguous {spec.dtype} {spec.shape(num_blocks)} on {self.group.device}")
        op = self._new_op(False, src_rank, transfer_id, num_blocks)
        op.spec, op.blocks = spec, out
        return self._submit(op)

    def lost_peers(self) -> dict[int, str]:
        """Peers this group can no longer reach, and why (a copy)."""
        with self._lock:
            return dict(self._lost)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and join the threads; a waiter blocked on the network takes
        until its transfer's deadline. Does not close the group."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(None)
        self._threads[0].join(timeout_s)  # the poster: no waiter thread starts after it ends
        for t in self._threads[1:]:
            t.join(timeout_s)

    def _new_op(self, is_send: bool, peer: int, transfer_id: int, num_blocks: int) -> _Op:
        if not 0 <= transfer_id <= MAX_TRANSFER_ID:
            raise ValueError(f"transfer_id={transfer_id} must be in [0, {MAX_TRANSFER_ID}]")
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if not 0 <= peer < self.group.world_size or peer == self.group.rank:
            raise ValueError(f"peer rank {peer} is not another rank of world size {self.group.world_size}")
        now = time.perf_counter()
        return _Op(is_send, peer, transfer_id, num_blocks, now + self._timeout_s, Future(), start=now)

    def _submit(self, op: _Op) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("BlockTransfer is closed")
            self._requests.put(op)
        return op.future

    def _start_thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _fail(self, op: _Op, reason: str, lose_peer: bool = True) -> None:
        if lose_peer:
            with self._lock:
                self._lost.setdefault(op.peer, reason)
        op.future.set_exception(TransferError(op.peer, op.transfer_id, reason))

    def _post_loop(self) -> None:
        """The transfer thread: posts ops in request order, never waits on the network."""
        while (op := self._requests.get()) is not None:
            if not op.future.set_running_or_notify_cancel():
                continue
            lost = self.lost_peers().get(op.peer)
            if lost is not None:
                self._fail(op, f"peer lost earlier: {lost}", lose_peer=False)
                continue
            try:
                self._post(op)
            except RuntimeError as e:
                self._fail(op, f"post failed: {e}")
                continue
            except Exception as e:  # a bug (or a raising fault hook): the caller sees it
                op.future.set_exception(e)
                continue
            key = (op.peer, op.is_send)
            if key not in self._waiters:
                self._waiters[key] = queue.SimpleQueue()
                name = f"kvmesh-transfer-{'send' if op.is_send else 'recv'}-{op.peer}"
                self._start_thread(self._wait_loop, name, self._waiters[key])
            self._waiters[key].put(op)
        for q in self._waiters.values():
            q.put(None)

    def _post(self, op: _Op) -> None:
        assert op.spec is not None
        g, tag, n = self.group, 3 * op.transfer_id, op.num_blocks
        nbytes = n * op.spec.bytes_per_block
        preamble = torch.tensor([_MAGIC, op.transfer_id, n, nbytes], dtype=torch.int64, device=g.device)
        if op.is_send:
            assert op.blocks is not None
            payload = op.blocks.view(-1).view(torch.uint8)  # [nbytes]
            works = [g.isend(preamble, op.peer, tag)]
            if self._fault_hook is None:  # the payload is on the wire while we hash it
                works.append(g.isend(payload, op.peer, tag + 2))
            host = op.blocks if op.blocks.device.type == "cpu" else op.blocks.cpu()
            body = _encode_body(block_checksums(host, n), op.hashes).to(g.device)
            if self._fault_hook is not None:
                self._fault_hook(op.transfer_id, op.blocks)
                works.append(g.isend(payload, op.peer, tag + 2))
            works.append(g.isend(body, op.peer, tag + 1))
            op.bufs, op.works = (preamble, body, payload), tuple(works)
            return
        body = torch.empty(3 * n, dtype=torch.int64, device=g.device)
        if op.blocks is None:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=g.device)
        else:
            payload = op.blocks.view(-1).view(torch.uint8)  # [nbytes], the caller's `out`
        op.bufs = (torch.empty_like(preamble), body, payload)
        op.works = (g.irecv(op.bufs[0], op.peer, tag),)
        if self._post_all:  # NCCL matches by order: preamble, payload, body, as the sender posts
            op.works += self._post_rest(op)

    def _post_rest(self, op: _Op) -> tuple[Any, ...]:
        tag = 3 * op.transfer_id
        return (self.group.irecv(op.bufs[2], op.peer, tag + 2), self.group.irecv(op.bufs[1], op.peer, tag + 1))

    def _wait_loop(self, q: queue.SimpleQueue[_Op | None]) -> None:
        """Completes, in order, the sends to one peer (or the receives from it). A send
        completes only once the peer's receive waiter posted the body, so sends and
        receives wait apart: two workers pulling from each other cannot deadlock."""
        while (op := q.get()) is not None:
            try:
                if op.is_send:
                    for w in op.works:
                        self.group.wait(w, op.deadline - time.perf_counter())
                    assert op.spec is not None
                    nbytes = op.num_blocks * op.spec.bytes_per_block
                    op.future.set_result(SendResult(op.num_blocks, nbytes, time.perf_counter() - op.start))
                else:
                    self._finish_recv(op)
            except RuntimeError as e:
                self._fail(op, str(e).split(". This is typically")[0])
            except TransferError as e:
                self._fail(op, e.reason)
            except Exception as e:  # a bug: the caller sees it, the thread lives on
                op.future.set_exception(e)
            finally:
                op.blocks, op.bufs, op.works = None, (), ()

    def _finish_recv(self, op: _Op) -> None:
        assert op.spec is not None
        g, (preamble, body, payload) = self.group, op.bufs
        g.wait(op.works[0], op.deadline - time.perf_counter())
        expected = [_MAGIC, op.transfer_id, op.num_blocks, payload.numel()]
        if (got := preamble.tolist()) != expected:
            # not posting the body and payload: a too-large message would kill this process
            raise TransferError(op.peer, op.transfer_id, f"preamble {got} != expected {expected}")
        works = op.works[1:] or self._post_rest(op)  # gloo: only now that the sizes are known
        for w in works:
            g.wait(w, op.deadline - time.perf_counter())
        blocks = payload.view(op.spec.dtype).view(op.spec.shape(op.num_blocks))
        checksums, hashes = _decode_body(body.cpu(), op.num_blocks)
        host = blocks if blocks.device.type == "cpu" else blocks.cpu()
        ok = tuple(a == b for a, b in zip(block_checksums(host, op.num_blocks), checksums))
        op.future.set_result(ReceivedBlocks(blocks, tuple(hashes), ok))
