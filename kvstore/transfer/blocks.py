"""Peer-to-peer KV block transfer over a `PairGroup` (gloo on CPU, NCCL on GPU).

A worker owns one `BlockTransfer`; the peer plane (`worker.peer.plane`, on the server's event
loop) calls `send` / `recv` on a pair (`kvstore.transfer.group.PairGroup`, formed on demand)
and gets a Future; the transfer's own threads wait for the network, so neither the event
loop nor the engine thread ever blocks on it. Blocks travel as gathered by
`KVTensors.gather_blocks`: `[num_layers, 2, n, block_size, H, D | slot_bytes]`, so quantized
pools move plain bytes. The cost model and the link measurements: `kvstore.transfer.cost`.

Wire v2, per transfer (tags `TAGS * transfer_id + offset`, offsets in `transfer_wire`:
transfers never cross):
  preamble  int64[4]   MAGIC (with WIRE_VERSION), transfer_id, num_blocks, payload bytes
  READY     int64[4]   (gloo only, receiver -> sender) the preamble the receiver expects
  pieces    uint8[..]  the contiguous gathered tensor, viewed as bytes, cut along the layer
                       dim into `num_pieces(L)` contiguous pieces (no copy)
  body      int64[3n]  xxh3_64 of each block's bytes, block hash high / low 64 bits
The receiver posts every receive at once (preamble, pieces into the final buffer, body) and,
on gloo, sends READY; the sender posts the payload only once READY equals its own preamble,
so no message is ever larger than the receive posted for it, and the payload's sends find
their receives already posted. (v1 had the gloo receiver post the pieces only after the
preamble arrived: the payload then waited on a wake-up of the receiver's waiter and went out
from gloo's I/O thread; in raw gloo sends of the same five pieces, on the dev box under a
load of ~5, that cost a median 43 ms against 26 ms for receives posted up front.) The sender
hashes each piece just after posting it, so its bytes are read from cache, once, while the
wire moves them; the receiver hashes piece p while pieces p+1.. are still arriving, so
verifying costs only the last piece after the last byte. A block whose checksum does not
match is marked bad in `ReceivedBlocks.ok` (the caller recomputes it); only a lost peer, a
timeout or a protocol mismatch (a v1 peer, another layout or block count) fails the whole
transfer, with `TransferError`, and breaks the pair. A v1 sender does not wait for READY: if
its payload were larger than a v2 receiver's buffers, the receiving process would die, so
upgrade the workers of a cluster together.

The checksum is xxh3_64 rather than crc32: crc32 hashed several times slower than xxh3
here, slower than gloo loopback moves bytes. It is computed by the worker's native kernel when
built (`checksum_kernel`: worker/kernels/csrc/block_hash.cpp, one call per piece, AVX-512 or
AVX2, GIL released; on the dev box ~75 GB/s on a piece in cache against ~30 GB/s for the
python path's one `xxhash` update per (plane, block) chunk), else by python-xxhash; both give
the same digests, so the wire does not say which, and either side may lack the kernel.

What gloo (torch 2.13) does on failure, found by experiment, and what this module does:
- A peer process that dies: every pending and later op with it fails at once with
  "Connection closed by peer". -> `TransferError` within milliseconds; the pair is broken.
- A peer that is alive but never sends (or never receives): `work.wait(timeout)` raises
  after the timeout and gloo closes the pair ("Application timeout caused pair closure"),
  on both sides, for good. Gloo can neither cancel nor poll an op. Hence one two-member
  group per pair: a timeout breaks only that pair, `on_broken` tells its owner, who drops
  it; the next fetch forms a new one (`worker.peer.plane`).
- A message larger than the posted receive buffer makes gloo's I/O thread throw and the
  process terminate. Hence READY: the sender checks the receiver's expected sizes before
  posting the payload; a mismatch fails that transfer on both sides, never the process.
  Receives posted into buffers of a transfer that failed early stay posted (gloo cannot
  cancel them), so their buffers are held by the pair until it closes (`PairGroup.hold`).
- Waiting twice on one completed gloo op blocks: each op is waited exactly once.
- Sends rendezvous: a send completes only after the receiver posted the matching receive.
Because `wait` is the only completion signal, one thread posts every op in request order
(never waiting) and waiter threads, one per pair and direction, complete them: a slow peer
stalls only its own transfers, and two workers pulling from each other cannot deadlock.
CUDA blocks over gloo are staged through pinned host memory (written, not run here).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.transfer.group import PairGroup, TransferError
from kvstore.transfer.wire import (
    BODY,
    FIRST_PIECE,
    MAGIC,
    MAX_TRANSFER_ID,
    PREAMBLE,
    READY,
    TAGS,
    BlockHashers,
    BlockSpec,
    ChecksumKernel,
    ReceivedBlocks,
    RecvTimes,
    SendResult,
    block_checksums,
    decode_body,
    encode_body,
    num_pieces,
    split_pieces,
    to_wire,
    wire_device,
)

__all__ = ["MAX_TRANSFER_ID", "BlockSpec", "BlockTransfer", "ChecksumKernel", "ReceivedBlocks", "RecvTimes",
           "SendResult", "block_checksums"]

_BLOCK_DIM = 2

FaultHook = Callable[[int, torch.Tensor], None]
BrokenHook = Callable[[PairGroup, str], None]


@dataclass(slots=True)
class _Op:
    """One queued transfer (or, with `retire`, the end of a pair); `works` are its posted
    ops, completed by its pair's waiter."""

    is_send: bool
    pair: PairGroup
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
    hashing_s: float = 0.0
    retire: bool = False
    on_retired: Callable[[], None] | None = None


class BlockTransfer:
    """The transfer engine of one worker: queued sends and receives on any number of pairs
    run off the caller's thread. Futures fail with `TransferError` only; a failure breaks its
    pair (`PairGroup.broken`) and calls `on_broken(pair, reason)` once; `retire(pair)` ends a
    pair's waiters and closes it; `close()` stops the threads."""

    def __init__(self, timeout_s: float = 10.0, fault_hook: FaultHook | None = None,
                 on_broken: BrokenHook | None = None, checksum_kernel: ChecksumKernel | None = None) -> None:
        """`fault_hook(transfer_id, blocks)` (tests only) runs on the sender after the
        checksums are taken and before the bytes go out, e.g. to corrupt a block.
        `checksum_kernel` (the worker's native kernels, if built) hashes each piece in one
        call; without it the python path computes the same checksums."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        self._fault_hook, self._on_broken = fault_hook, on_broken
        self._checksum_kernel = checksum_kernel
        self._timeout_s = timeout_s
        self._requests: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._waiters: dict[tuple[int, bool], queue.SimpleQueue[_Op | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._start_thread(self._post_loop, "kvmesh-transfer")

    def send(self, pair: PairGroup, transfer_id: int, blocks: torch.Tensor,
             block_hashes: Sequence[int]) -> Future[SendResult]:
        """Send gathered `blocks` `[L, 2, n, bs, H, D]`; do not modify them until the future
        is done. The peer must call `recv` on its end of the pair with the same transfer_id and n."""
        spec = BlockSpec.of(blocks)
        n = blocks.shape[_BLOCK_DIM]
        if len(block_hashes) != n:
            raise ValueError(f"len(block_hashes)={len(block_hashes)} != num_blocks={n}")
        if bad := [h for h in block_hashes if not 0 <= h < 1 << 128]:
            raise ValueError(f"block_hashes has values outside [0, 2**128): {bad[:4]}")
        if blocks.device != pair.device:
            raise ValueError(f"blocks are on {blocks.device}; the pair sends from {pair.device}")
        op = self._new_op(True, pair, transfer_id, n)
        op.spec, op.blocks, op.hashes = spec, blocks.contiguous(), block_hashes
        return self._submit(op)

    def recv(self, pair: PairGroup, transfer_id: int, num_blocks: int, spec: BlockSpec,
             out: torch.Tensor | None = None) -> Future[ReceivedBlocks]:
        """Receive `num_blocks` blocks shaped by `spec`, into `out` (contiguous, on the wire
        device, `spec.shape(num_blocks)`; not to be touched until the future is done) or
        into a new tensor. A reused `out` staging buffer saves the page faults of a fresh
        allocation, which on the dev box cost as much as the transfer itself."""
        wire = wire_device(pair)
        if out is not None and (tuple(out.shape) != spec.shape(num_blocks) or out.dtype != spec.dtype
                                or not out.is_contiguous() or out.device != wire):
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected a "
                             f"contiguous {spec.dtype} {spec.shape(num_blocks)} on {wire}")
        op = self._new_op(False, pair, transfer_id, num_blocks)
        op.spec, op.blocks = spec, out
        return self._submit(op)

    def retire(self, pair: PairGroup) -> None:
        """No more ops on `pair`: after the ones queued, its waiters end and it is closed."""
        op = _Op(False, pair, 0, 0, 0.0, Future(), retire=True)
        with self._lock:
            if not self._closed:
                self._requests.put(op)
                return
        pair.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking requests and join the threads; a waiter blocked on the network takes
        until its transfer's deadline. Does not close the pairs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(None)
        self._threads[0].join(timeout_s)  # the poster: no waiter thread starts after it ends
        for t in self._threads[1:]:
            t.join(timeout_s)

    def _new_op(self, is_send: bool, pair: PairGroup, transfer_id: int, num_blocks: int) -> _Op:
        if not 0 <= transfer_id <= MAX_TRANSFER_ID:
            raise ValueError(f"transfer_id={transfer_id} must be in [0, {MAX_TRANSFER_ID}]")
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        now = time.perf_counter()
        return _Op(is_send, pair, transfer_id, num_blocks, now + self._timeout_s, Future(), start=now)

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

    def _fail(self, op: _Op, reason: str, break_pair: bool = True) -> None:
        if break_pair:
            with self._lock:
                first = op.pair.broken is None
                if first:
                    op.pair.broken = reason
            if first and self._on_broken is not None:
                self._on_broken(op.pair, reason)
        op.future.set_exception(TransferError(str(op.pair.peer), op.transfer_id, reason))

    def _post_loop(self) -> None:
        """The transfer thread: posts ops in request order, never waits on the network."""
        while (op := self._requests.get()) is not None:
            if op.retire:
                self._retire(op.pair)
                continue
            if not op.future.set_running_or_notify_cancel():
                continue
            if op.pair.broken is not None:
                self._fail(op, f"pair broken earlier: {op.pair.broken}", break_pair=False)
                continue
            try:
                self._post(op)
            except RuntimeError as e:
                self._fail(op, f"post failed: {e}")
                continue
            except Exception as e:  # a bug (or a raising fault hook): the caller sees it
                op.future.set_exception(e)
                continue
            key = (id(op.pair), op.is_send)
            if key not in self._waiters:
                self._waiters[key] = queue.SimpleQueue()
                name = f"kvmesh-transfer-{'send' if op.is_send else 'recv'}-{op.pair.peer}"
                self._start_thread(self._wait_loop, name, self._waiters[key])
            self._waiters[key].put(op)
        for q in self._waiters.values():
            q.put(None)

    def _retire(self, pair: PairGroup) -> None:
        queues = [self._waiters.pop((id(pair), d)) for d in (True, False) if (id(pair), d) in self._waiters]
        if not queues:
            pair.close()
            return
        done = _Countdown(len(queues), pair.close)
        for q in queues:
            q.put(_Op(False, pair, 0, 0, 0.0, Future(), retire=True, on_retired=done))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _post(self, op: _Op) -> None:
        assert op.spec is not None
        pair, tag, n = op.pair, TAGS * op.transfer_id, op.num_blocks
        wire = wire_device(pair)
        nbytes = n * op.spec.bytes_per_block
        preamble = torch.tensor([MAGIC, op.transfer_id, n, nbytes], dtype=torch.int64, device=wire)
        if op.is_send:
            assert op.blocks is not None
            blocks = to_wire(op.blocks, wire)
            op.bufs, op.works = (preamble, blocks), (pair.isend(preamble, tag + PREAMBLE),)
            if pair.backend == "gloo":  # the payload goes once the receiver's READY matches (`_finish_send`)
                ready = torch.empty_like(preamble)
                op.bufs, op.works = op.bufs + (ready,), op.works + (pair.irecv(ready, tag + READY),)
            else:                       # NCCL matches by order: preamble, pieces, body, as the receiver posts
                op.works += self._send_payload(op, blocks)
            return
        if op.blocks is None:
            op.blocks = torch.empty(op.spec.shape(n), dtype=op.spec.dtype, device=wire,
                                    pin_memory=wire.type == "cpu" and pair.device.type == "cuda")
        pieces = split_pieces(op.blocks, num_pieces(op.spec, n))
        body, got = torch.empty(3 * n, dtype=torch.int64, device=wire), torch.empty_like(preamble)
        op.bufs = (got, body, op.blocks, preamble)
        works = [pair.irecv(got, tag + PREAMBLE)]
        if pair.backend == "gloo":      # tell the sender what fits the receives posted here
            works.append(pair.isend(preamble, tag + READY))
        works += [pair.irecv(p.view(-1).view(torch.uint8), tag + FIRST_PIECE + i) for i, p in enumerate(pieces)]
        works.append(pair.irecv(body, tag + BODY))
        op.works = tuple(works)
        pair.hold(op.bufs)  # a broken pair may still hold these receives: their memory lives until it closes

    def _send_payload(self, op: _Op, blocks: torch.Tensor) -> tuple[Any, ...]:
        """Post the pieces, hashing each just after posting it (its bytes are read once from
        cache, while the wire moves them), then the body with the checksums."""
        assert op.spec is not None
        pair, tag, n = op.pair, TAGS * op.transfer_id, op.num_blocks
        pieces = split_pieces(blocks, num_pieces(op.spec, n))
        hashers, works = BlockHashers(n, op.spec.bytes_per_block, self._checksum_kernel), []
        t0 = time.perf_counter()
        if self._fault_hook is None:
            for i, p in enumerate(pieces):
                works.append(pair.isend(p.view(-1).view(torch.uint8), tag + FIRST_PIECE + i))
                t = time.perf_counter()
                hashers.update(p if p.device.type == "cpu" else p.cpu())
                op.hashing_s += time.perf_counter() - t
        else:  # tests: the hook sees the blocks after the checksums are taken, before any byte goes out
            hashers.update(blocks if blocks.device.type == "cpu" else blocks.cpu())
            op.hashing_s = time.perf_counter() - t0
            self._fault_hook(op.transfer_id, blocks)
            works += [pair.isend(p.view(-1).view(torch.uint8), tag + FIRST_PIECE + i) for i, p in enumerate(pieces)]
        body = encode_body(hashers.digests(), op.hashes).to(blocks.device)
        op.bufs += (body,)
        return (*works, pair.isend(body, tag + BODY))

    def _wait_loop(self, q: queue.SimpleQueue[_Op | None]) -> None:
        """Completes, in order, the sends on one pair (or its receives). A send completes only
        once the peer's receive was posted, so sends and receives wait apart."""
        while (op := q.get()) is not None:
            if op.retire:
                assert op.on_retired is not None
                op.on_retired()          # the last waiter of the pair closes it
                return
            try:
                if op.is_send:
                    self._finish_send(op)
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

    def _finish_send(self, op: _Op) -> None:
        assert op.spec is not None
        pair, works = op.pair, op.works   # each work is waited once: a second wait on a done gloo op hangs
        if pair.backend == "gloo":
            preamble, blocks, ready = op.bufs
            pair.wait(works[1], op.deadline - time.perf_counter())
            if (want := ready.tolist()) != (have := preamble.tolist()):
                # sending nothing more: the receiver posted receives sized for what it expects
                raise TransferError(str(pair.peer), op.transfer_id, f"receiver expects {want}; sending {have}")
            works = works[:1] + self._send_payload(op, blocks)
        for w in works:
            pair.wait(w, op.deadline - time.perf_counter())
        nbytes = op.num_blocks * op.spec.bytes_per_block
        op.future.set_result(SendResult(op.num_blocks, nbytes, time.perf_counter() - op.start, op.hashing_s))

    def _finish_recv(self, op: _Op) -> None:
        assert op.spec is not None
        pair, (got, body, blocks, preamble) = op.pair, op.bufs
        wait = lambda w: pair.wait(w, op.deadline - time.perf_counter())  # noqa: E731
        wait(op.works[0])
        if (have := got.tolist()) != (want := preamble.tolist()):
            # the sender (this wire version) sends no payload then; the pair breaks
            raise TransferError(str(pair.peer), op.transfer_id, f"preamble {have} != expected {want}")
        first = 2 if pair.backend == "gloo" else 1
        if first == 2:
            wait(op.works[1])           # our READY: the sender has posted its receive of it
        hashers, arrived = BlockHashers(op.num_blocks, op.spec.bytes_per_block, self._checksum_kernel), []
        pieces = split_pieces(blocks, len(op.works) - first - 1)
        for w, piece in zip(op.works[first:-1], pieces):    # verify piece p while the next ones arrive
            wait(w)
            arrived.append(time.perf_counter())
            hashers.update(piece if piece.device.type == "cpu" else piece.cpu())
            op.hashing_s += time.perf_counter() - arrived[-1]
        wait(op.works[-1])
        checksums, hashes = decode_body(body.cpu(), op.num_blocks)
        ok = tuple(a == b for a, b in zip(hashers.digests(), checksums))
        pair.release(op.bufs)
        end = time.perf_counter()
        times = RecvTimes(arrived[0] - op.start, arrived[-1] - op.start, op.hashing_s, end - op.start)
        op.future.set_result(ReceivedBlocks(blocks, tuple(hashes), ok, times))


class _Countdown:
    """Calls `fn` on the `count`-th call (the last waiter of a retired pair closes it)."""

    def __init__(self, count: int, fn: Callable[[], None]) -> None:
        self._left, self._fn, self._lock = count, fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._fn()
