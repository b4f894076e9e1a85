"""Peer block transfer: two real processes over gloo on loopback, plus the cost model.

This process hosts the rendezvous store and is member 0 of each pair (it receives);
`tests/kvstore/transfer_peer.py` is member 1. The oracle is the sender's pool rebuilt here
from the same seed and gathered with `gather_blocks`.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvstore.errors import KVStoreError
from kvstore.tensors import KVTensors
from kvstore.transfer.blocks import BlockSpec, BlockTransfer, block_checksums
from kvstore.transfer.cost import CostModel, LinkEstimate, peer_vs_raw
from kvstore.transfer.group import PairGroup, PeerId, RendezvousStore, TransferConfig, TransferError, connect_store
from kvstore.transfer.wire import BlockHashers, ChecksumKernel, num_pieces
from tests.kvstore.transfer_peer import CORRUPT_INDEX, HASHES, LAYOUTS, SEND_IDS, TRANSFER_IDS, make_pool

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def peer(mode: str, timeout_s: float = 10.0, checksum_kernel: ChecksumKernel | None = None
         ) -> Iterator[tuple[BlockTransfer, dict[str, PairGroup], subprocess.Popen[bytes]]]:
    """Start the peer process in `mode`, form its pair(s) here as member 0 (keyed by mode:
    `silent` and `late` for silent+late), and clean both up. A broken pair is retired. The
    peer hashes in python; this side with `checksum_kernel` if given (tests/worker/test_block_hash.py)."""
    store = RendezvousStore("127.0.0.1", 0, 30.0)
    proc = subprocess.Popen([sys.executable, "-m", "tests.kvstore.transfer_peer", store.address(), mode], cwd=REPO)
    cfg = TransferConfig(timeout_s=timeout_s, connect_timeout_s=30.0)
    pairs: dict[str, PairGroup] = {}
    transfer = BlockTransfer(timeout_s, on_broken=lambda pair, why: transfer.retire(pair),
                             checksum_kernel=checksum_kernel)
    try:
        for key in mode.split("+"):
            pairs[key] = PairGroup.form(key, store.store, 0, PeerId(f"peer-{key}", 1), "cpu", cfg)
        yield transfer, pairs, proc
    finally:
        transfer.close(timeout_s=timeout_s)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pair in pairs.values():
            pair.close()


def _spec(kind: str) -> BlockSpec:
    return BlockSpec.of(KVTensors(LAYOUTS[kind], 1).kv)


@pytest.mark.multiproc
def test_round_trip_is_bit_exact_fp32_and_int8_both_directions() -> None:
    check_round_trip()


def check_round_trip(checksum_kernel: ChecksumKernel | None = None) -> None:
    with peer("roundtrip", checksum_kernel=checksum_kernel) as (transfer, pairs, proc):
        pair = pairs["roundtrip"]
        # the peer receives from us while it sends to us: neither side may deadlock
        sent = transfer.send(pair, TRANSFER_IDS["reverse"], make_pool("fp32", seed=2).gather_blocks(SEND_IDS), HASHES)
        for kind in ("fp32", "int8"):
            got = transfer.recv(pair, TRANSFER_IDS[kind], len(SEND_IDS), _spec(kind)).result(timeout=20)
            expected = make_pool(kind, seed=1).gather_blocks(SEND_IDS)
            assert got.blocks.dtype == expected.dtype and torch.equal(got.blocks, expected), kind
            assert got.ok == (True,) * len(SEND_IDS) and got.bad_indices == []
            assert list(got.block_hashes) == HASHES
            # the received blocks land in a pool like any gathered blocks
            pool = KVTensors(LAYOUTS[kind], 8)
            pool.scatter_blocks([0, 1, 2, 6], got.blocks)
            assert torch.equal(pool.gather_blocks([0, 1, 2, 6]), expected)
        assert sent.result(timeout=20).num_bytes == len(SEND_IDS) * _spec("fp32").bytes_per_block
        assert proc.wait(timeout=20) == 0  # the peer checked what it received too


@pytest.mark.multiproc
def test_corrupted_block_is_marked_bad_and_only_that_block() -> None:
    check_corrupted_block()


def check_corrupted_block(checksum_kernel: ChecksumKernel | None = None) -> None:
    with peer("corrupt", checksum_kernel=checksum_kernel) as (transfer, pairs, proc):
        out = torch.zeros(_spec("fp32").shape(len(SEND_IDS)))  # a reused staging buffer
        got = transfer.recv(pairs["corrupt"], TRANSFER_IDS["corrupt"], len(SEND_IDS), _spec("fp32"),
                            out=out).result(timeout=20)
        expected = make_pool("fp32", seed=3).gather_blocks(SEND_IDS)
        assert got.blocks.data_ptr() == out.data_ptr()
        assert got.bad_indices == [CORRUPT_INDEX]
        assert list(got.block_hashes) == HASHES
        for j in range(len(SEND_IDS)):
            same = torch.equal(got.blocks[:, :, j], expected[:, :, j])
            assert same == (j != CORRUPT_INDEX), j
        assert proc.wait(timeout=20) == 0


@pytest.mark.multiproc
def test_peer_killed_mid_transfer_fails_fast_and_receiver_lives_on() -> None:
    with peer("die", timeout_s=8.0) as (transfer, pairs, proc):
        pair = pairs["die"]
        t0 = time.perf_counter()
        future = transfer.recv(pair, TRANSFER_IDS["die"], len(SEND_IDS), _spec("fp32"))
        with pytest.raises(TransferError) as info:
            future.result(timeout=20)
        elapsed = time.perf_counter() - t0
        assert proc.wait(timeout=10) == 17  # the peer did send the preamble, then died
        assert elapsed < 8.0  # gloo reports a closed connection at once, not at the timeout
        assert isinstance(info.value, KVStoreError) and info.value.peer == "peer-die#1"
        assert pair.broken
        # later transfers on the broken pair fail at once too; this process carries on
        t1 = time.perf_counter()
        with pytest.raises(TransferError, match="pair broken earlier"):
            transfer.recv(pair, 99, 1, _spec("fp32")).result(timeout=20)
        assert time.perf_counter() - t1 < 1.0


@pytest.mark.multiproc
def test_silent_peer_times_out_and_only_that_pair_breaks() -> None:
    # one peer process holds two pairs: `silent` (alive, never sends) and `late` (sends)
    with peer("silent+late", timeout_s=1.0) as (transfer, pairs, proc):
        t0 = time.perf_counter()
        with pytest.raises(TransferError, match="Timed out"):
            transfer.recv(pairs["silent"], TRANSFER_IDS["silent"], len(SEND_IDS), _spec("fp32")).result(timeout=20)
        elapsed = time.perf_counter() - t0
        assert 0.9 < elapsed < 3.0, elapsed
        assert proc.poll() is None  # the peer is alive: gloo closed the pair, not the process
        assert pairs["silent"].broken and pairs["late"].broken is None
        # the other pair survived the timeout (in one shared gloo group it would not)
        got = transfer.recv(pairs["late"], TRANSFER_IDS["late"], len(SEND_IDS), _spec("fp32")).result(timeout=20)
        assert torch.equal(got.blocks, make_pool("fp32", seed=3).gather_blocks(SEND_IDS)) and all(got.ok)
        assert proc.wait(timeout=20) == 0


@pytest.mark.multiproc
def test_size_mismatch_fails_both_sides_and_no_payload_is_sent() -> None:
    """The receiver posts its receives before it knows what the sender sends (wire v2); a
    sender that would send more than they hold sees the receiver's READY and sends nothing
    (gloo would kill the receiving process on a message larger than its buffer)."""
    with peer("mismatch") as (transfer, pairs, proc):
        fewer = len(SEND_IDS) - 2
        with pytest.raises(TransferError, match="preamble"):
            transfer.recv(pairs["mismatch"], TRANSFER_IDS["mismatch"], fewer, _spec("fp32")).result(timeout=20)
        assert pairs["mismatch"].broken
        assert proc.wait(timeout=20) == 0  # its send failed on our READY, before any payload went


@pytest.mark.multiproc
def test_peer_vs_raw_runs_and_reports_figures() -> None:
    spec = _spec("fp32")
    r = peer_vs_raw(spec, num_blocks=16, repeats=2)
    assert r.num_bytes == 16 * spec.bytes_per_block
    assert r.peer_bytes_s > 0 and r.raw_bytes_s > 0 and r.peer_alloc_bytes_s > 0
    assert r.peer_cpu_s > 0 and r.raw_cpu_s > 0   # both processes' threads, summed on the receiver
    ph = r.phases
    assert 0 < ph.first_piece_s <= ph.last_piece_s <= ph.total_s and ph.recv_hashing_s > 0 and ph.send_hashing_s > 0
    assert r.ratio == pytest.approx(r.peer_bytes_s / r.raw_bytes_s)
    assert r.link.bandwidth_bytes_s > 0 and r.link.latency_s > 0


def test_block_checksums_cover_every_plane_of_each_block_and_nothing_else() -> None:
    blocks = make_pool("fp32", seed=5).gather_blocks(SEND_IDS)  # [3, 2, 4, 4, 2, 8]
    base = block_checksums(blocks, len(SEND_IDS))
    assert len(set(base)) == len(SEND_IDS)
    for layer, kv in ((0, 0), (2, 1)):
        changed = blocks.clone()
        changed[layer, kv, 1, 3, 1, 7] += 1.0  # the last element of block 1 in this plane
        sums = block_checksums(changed, len(SEND_IDS))
        assert [a != b for a, b in zip(base, sums)] == [False, True, False, False]


def test_config_validation_and_backend_choice() -> None:
    config = TransferConfig()
    assert config.resolve_backend(torch.device("cpu")) == "gloo"
    assert config.resolve_backend(torch.device("cuda", 0)) == "nccl"
    for kw in (dict(backend="mpi"), dict(timeout_s=0.0), dict(connect_timeout_s=-1.0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            TransferConfig(**kw)  # type: ignore[arg-type]
    for kw in (dict(worker_id=""), dict(worker_id="a b"), dict(generation=-1)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            PeerId(**(dict(worker_id="w", generation=1) | kw))  # type: ignore[arg-type]
    assert str(PeerId("w-0", 7)) == "w-0#7"


@pytest.mark.server
def test_a_pair_nobody_joins_fails_within_the_connect_timeout() -> None:
    """Forming is bounded on both sides: the receiver waiting at its store, the sender at a
    store nobody serves, the sender at a store where the receiver never forms."""
    store = RendezvousStore("127.0.0.1", 0, 30.0)
    cfg = TransferConfig(timeout_s=1.0, connect_timeout_s=1.0)
    for form in (lambda: PairGroup.form("k0", store.store, 0, PeerId("x", 1), "cpu", cfg),
                 lambda: PairGroup.form("k1", connect_store(store.address(), 1.0), 1, PeerId("x", 1), "cpu", cfg),
                 lambda: connect_store("127.0.0.1:1", 1.0)):
        t0 = time.perf_counter()
        with pytest.raises(TransferError):
            form()
        assert time.perf_counter() - t0 < 5.0


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="checks the no-NCCL build")
def test_nccl_on_a_build_without_it_is_a_typed_error() -> None:
    store = RendezvousStore("127.0.0.1", 0, 5.0)
    with pytest.raises(TransferError, match="no NCCL"):
        PairGroup.form("k", store.store, 0, PeerId("x", 1), "cpu", TransferConfig(backend="nccl"))


def test_block_spec_sizes_match_the_layout() -> None:
    for kind, layout in LAYOUTS.items():
        spec = _spec(kind)
        assert spec.bytes_per_block == layout.bytes_per_block, kind
        assert spec.shape(3) == tuple(KVTensors(layout, 5).gather_blocks([0, 1, 2]).shape)


def test_cost_model_arithmetic() -> None:
    model = CostModel.from_link(LinkEstimate(bandwidth_bytes_s=1e9, latency_s=1e-3),
                                prefill_tokens_per_s=2000.0, checksum_bytes_s=4e9)
    # 10 blocks of 1 MB: 1 ms + 10 ms on the wire + 2.5 ms to verify the checksums
    assert model.fetch_s(10, 1_000_000) == pytest.approx(0.0135)
    assert model.recompute_s(160) == pytest.approx(0.08)
    assert model.should_fetch(10, 1_000_000, block_size=16)  # 13.5 ms < 80 ms
    # a slow link: 10 MB at 100 MB/s = 100 ms > 80 ms of prefill
    slow = CostModel(bandwidth_bytes_s=1e8, latency_s=1e-3, prefill_tokens_per_s=2000.0)
    assert slow.fetch_s(10, 1_000_000) == pytest.approx(0.101)
    assert not slow.should_fetch(10, 1_000_000, block_size=16)
    assert not model.should_fetch(0, 1_000_000, block_size=16)
    # latency dominates tiny fetches: 1 block of 1 KB vs 1 token of prefill (0.5 ms)
    assert not model.should_fetch(1, 1000, block_size=1)
    assert math.isinf(CostModel(1e9, 0.0, 1.0).checksum_bytes_s)
    for kw in (dict(bandwidth_bytes_s=0.0), dict(latency_s=-1.0), dict(prefill_tokens_per_s=0.0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            CostModel(**(dict(bandwidth_bytes_s=1e9, latency_s=0.0, prefill_tokens_per_s=1.0) | kw))  # type: ignore[arg-type]


def test_bad_arguments_raise_at_the_call_not_in_the_future() -> None:
    pair = PairGroup("k", PeerId("x", 1), 0, torch.device("cpu"), "gloo", None, None)   # never formed: no op runs
    transfer = BlockTransfer(5.0)
    try:
        blocks = make_pool("fp32", seed=6).gather_blocks([0, 1])
        with pytest.raises(ValueError, match="block_hashes"):
            transfer.send(pair, 1, blocks, [1 << 128, 0])
        with pytest.raises(ValueError, match="len\\(block_hashes\\)"):
            transfer.send(pair, 1, blocks, [1])
        with pytest.raises(ValueError, match="transfer_id"):
            transfer.recv(pair, -1, 2, _spec("fp32"))
        with pytest.raises(ValueError, match="num_blocks"):
            transfer.recv(pair, 1, 0, _spec("fp32"))
        with pytest.raises(ValueError, match="out is"):
            transfer.recv(pair, 1, 2, _spec("fp32"), out=torch.zeros(_spec("fp32").shape(3)))
        with pytest.raises(ValueError, match="timeout_s"):
            BlockTransfer(0.0)
    finally:
        transfer.close()


def test_piecewise_hashing_equals_whole_payload_hashing() -> None:
    """The receiver hashes piece by piece as they arrive: same digests as the whole payload."""
    blocks = torch.randn(7, 2, 5, 4, 2, 8)                      # [L, 2, n, bs, H, D], 7 layers
    whole = block_checksums(blocks, 5)
    for count in (1, 2, 3, 7):
        hashers = BlockHashers(5, blocks.numel() * 4 // 5)
        for piece in torch.tensor_split(blocks, count, dim=0):
            hashers.update(piece)
        assert hashers.digests() == whole, count
    big = BlockSpec(num_layers=30, block_size=16, num_kv_heads=3, last_dim=64, dtype=torch.float32)
    assert num_pieces(big, 1) == 1 and 1 < num_pieces(big, 64) <= 8
