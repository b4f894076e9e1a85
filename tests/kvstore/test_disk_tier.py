"""The disk tier on a real directory: records round-trip, survive a reopen and a kill -9 of the
writer, are never served when torn, flipped or truncated, are keyed by salt root, stay under
their LRU bound; a full, gone or unusable disk turns the tier off with one log line."""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore.disk import DiskTier
from kvstore.disk_record import HEADER_BYTES, SlabIO, slot_bytes
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import AllBlocksCleared, BlockRemoved, BlockStored

LAYOUT = KVLayout(2, 2, 8, 4, "fp32")
SHAPE = (2, 2, 4, 2, 8)                       # [L, 2, bs, H, D]
RECORD = slot_bytes(LAYOUT.bytes_per_block)
FP = b"fingerprint-0001"


def _block(i: int) -> torch.Tensor:
    return torch.arange(64 * 2 * 2, dtype=torch.float32).view(SHAPE) + 1000.0 * i


def _open(path: Path, num_records: int = 64, fingerprint: bytes = FP, **kw) -> DiskTier:
    return DiskTier.open(path, num_records * RECORD, LAYOUT, torch.float32, SHAPE, fingerprint, **kw)


def _fill(tier: DiskTier, ids: range, root: BlockHash | None = None) -> None:
    for i in ids:
        assert tier.write_behind((root, BlockHash(i)), _block(i))
    tier.flush()


def _read(tier: DiskTier, ids: range, root: BlockHash | None = None) -> list[torch.Tensor]:
    """The blocks a read-ahead of `ids` gives back, in order (stops at the first miss)."""
    if not tier.read_ahead([(root, BlockHash(i)) for i in ids]):
        return []
    deadline = time.monotonic() + 10
    while not (done := tier.take_reads()):
        assert time.monotonic() < deadline
        tier.wait_reads(0.1)
    (read,) = done
    return [] if read.blocks is None else [read.blocks[:, :, k] for k in range(len(read.keys))]


def _disk_bytes(tier: DiskTier) -> int:
    """The bytes the tier's slab files take (their sizes: sparse files count their holes)."""
    return sum(p.stat().st_size for p in tier.dir.glob("slab-*.kvs"))


def _at(tier: DiskTier, key) -> tuple[Path, int]:
    loc = tier.record_location(key)
    assert loc is not None
    return Path(loc[0]), loc[1]


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def test_records_round_trip_with_events(tmp_path):
    tier = _open(tmp_path)
    tier.set_event_recording(True)
    _fill(tier, range(1, 6))
    assert tier.match_prefix(None, [BlockHash(i) for i in (1, 2, 3, 9, 4)]) == 3
    got = _read(tier, range(1, 6))
    assert len(got) == 5 and all(torch.equal(g, _block(i)) for g, i in zip(got, range(1, 6)))
    assert tier.take_events() == [BlockStored(BlockHash(i), None, 0) for i in range(1, 6)]
    st = tier.stats()
    assert (st.written, st.read, st.num_blocks, st.used_bytes) == (5, 5, 5, 5 * RECORD)
    assert st.write_seconds.count == 5 and st.read_seconds.count == 1
    tier.check_integrity()
    tier.close()


def test_reopen_keeps_records_without_reading_payloads(tmp_path):
    tier = _open(tmp_path)
    _fill(tier, range(1, 9))
    tier.close()
    again = _open(tmp_path)
    assert again.stats().reopened == 8 and again.stats().read == 0
    assert sorted(again.cached_hashes()) == list(range(1, 9))
    assert torch.equal(_read(again, range(3, 4))[0], _block(3))
    again.close()


def test_flipped_payload_byte_is_dropped_not_served(tmp_path, caplog):
    tier = _open(tmp_path)
    tier.set_event_recording(True)
    _fill(tier, range(1, 4))
    tier.take_events()
    path, offset = _at(tier, (None, BlockHash(2)))
    _flip(path, offset + HEADER_BYTES + 100)
    with caplog.at_level(logging.WARNING, "kvmesh.disk"):
        got = _read(tier, range(1, 4))
    assert len(got) == 1 and torch.equal(got[0], _block(1))            # the run stops at the bad record
    assert tier.stats().dropped_checksum == 1 and tier.record_location((None, BlockHash(2))) is None
    with open(path, "rb") as f:                                         # its slot is erased: empty
        f.seek(offset)
        assert f.read(HEADER_BYTES) == bytes(HEADER_BYTES)
    assert tier.match_prefix(None, [BlockHash(2)]) == 0
    assert tier.take_events() == [BlockRemoved(BlockHash(2), 0)]
    assert "checksum mismatch" in caplog.text
    tier.close()


def test_flipped_header_and_truncated_records_are_dropped_at_reopen(tmp_path):
    tier = _open(tmp_path)
    _fill(tier, range(1, 5))
    tier.close()
    where = {i: _at(tier, (None, BlockHash(i))) for i in range(1, 5)}
    tier.close()
    path, offset = where[1]
    _flip(path, offset + 20, 0xFF)                                     # inside the block hash field
    # cut a slab file inside its last record (the records before it in that file stay whole)
    last = max((i for i in range(2, 5)), key=lambda i: (where[i][0] == where[2][0], where[i][1]))
    os.truncate(where[last][0], where[last][1] + RECORD // 2)
    again = _open(tmp_path)
    assert sorted(again.cached_hashes()) == sorted({2, 3, 4} - {last}) and again.stats().dropped_checksum == 2
    assert again.stats().reopened == 2
    again.close()


def test_truncated_after_open_is_not_served(tmp_path):
    tier = _open(tmp_path)
    _fill(tier, range(1, 3))
    path, offset = _at(tier, (None, BlockHash(1)))
    os.truncate(path, offset + HEADER_BYTES + LAYOUT.bytes_per_block - 7)
    assert _read(tier, range(1, 3)) == []
    assert tier.stats().dropped_checksum == 1
    tier.close()


def test_other_fingerprint_is_ignored_and_said_once(tmp_path, caplog):
    tier = _open(tmp_path)
    _fill(tier, range(1, 4))
    tier.close()
    with caplog.at_level(logging.WARNING, "kvmesh.disk"):
        other = _open(tmp_path, fingerprint=b"another-model-16")
    assert other.num_blocks == 0 and other.match_prefix(None, [BlockHash(1)]) == 0
    said = [r for r in caplog.records if "fingerprint" in r.getMessage()]
    assert len(said) == 1
    other.close()
    back = _open(tmp_path)                                             # the first model's records are intact
    assert back.num_blocks == 3
    back.close()


def test_salt_root_is_part_of_the_key_and_checked_on_read(tmp_path):
    tier = _open(tmp_path)
    a, b = BlockHash(111), BlockHash(222)
    _fill(tier, range(1, 3), root=a)
    assert tier.match_prefix(a, [BlockHash(1), BlockHash(2)]) == 2
    assert tier.match_prefix(None, [BlockHash(1)]) == 0 and tier.match_prefix(b, [BlockHash(1)]) == 0
    assert _read(tier, range(1, 2), root=b) == []
    # a record's root field changed on disk fails the header check: never served under any root
    path, offset = _at(tier, (a, BlockHash(1)))
    tier.close()
    _flip(path, offset + 4 + 2 + 2 + 16 + 16)                          # the salt root field
    again = _open(tmp_path)
    assert again.match_prefix(b, [BlockHash(1)]) == 0 and again.match_prefix(a, [BlockHash(1)]) == 0
    assert again.stats().dropped_checksum == 1 and again.match_prefix(a, [BlockHash(2)]) == 1   # the other intact
    again.close()


def test_lru_bound_evicts_oldest_and_a_read_refreshes(tmp_path):
    tier = _open(tmp_path, num_records=3)
    tier.set_event_recording(True)
    _fill(tier, range(1, 4))
    assert len(_read(tier, range(1, 2))) == 1                          # 1 becomes the youngest
    _fill(tier, range(4, 6))
    assert sorted(tier.cached_hashes()) == [1, 4, 5] and _disk_bytes(tier) == 3 * RECORD
    assert tier.stats().evicted == 2 and tier.used_bytes <= 3 * RECORD
    removed = [e.block_hash for e in tier.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [2, 3]
    tier.check_integrity()
    tier.close()


class _BlockedIO(SlabIO):
    """A disk that takes its time: each write waits for `go`."""

    def __init__(self) -> None:
        import threading
        super().__init__()
        self.go = threading.Event()

    def write(self, slot, header, payload):
        self.go.wait(10)
        super().write(slot, header, payload)


def test_full_queue_drops_the_write_and_counts_it(tmp_path):
    io = _BlockedIO()
    tier = _open(tmp_path, max_queue=2, io=io)
    # With the disk blocked, at most 2 (the queue) + one in each writer's blocked write are taken in;
    # every later one is dropped.
    t0 = time.perf_counter()
    results = [tier.write_behind((None, BlockHash(i)), _block(i)) for i in range(1, 21)]
    assert time.perf_counter() - t0 < 1.0                              # never waits for the disk
    assert results.count(True) <= 2 + tier._writer.writers and results[-1] is False
    assert tier.stats().dropped_queue_full == results.count(False)
    io.go.set()
    tier.flush()
    assert tier.num_blocks == results.count(True)
    tier.close()


class _FullDisk(SlabIO):
    """ENOSPC after `room` records, as a full file system answers write(2)."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, slot, header, payload):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.location(slot)[0])
        self.room -= 1
        super().write(slot, header, payload)


def test_disk_full_turns_the_tier_off_with_one_line(tmp_path, caplog):
    tier = _open(tmp_path, io=_FullDisk(2))
    tier.set_event_recording(True)
    with caplog.at_level(logging.ERROR, "kvmesh.disk"):
        for i in range(1, 6):
            tier.write_behind((None, BlockHash(i)), _block(i))
        tier.flush()
    assert not tier.enabled and tier.num_blocks == 0
    assert isinstance(tier.take_events()[-1], AllBlocksCleared)
    lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "No space left" in lines[0].getMessage()
    assert not tier.write_behind((None, BlockHash(9)), _block(9)) and not tier.read_ahead([(None, BlockHash(1))])
    tier.close()


def test_directory_gone_turns_the_tier_off(tmp_path, caplog):
    import shutil
    tier = _open(tmp_path / "kv")
    _fill(tier, range(1, 3))
    shutil.rmtree(tmp_path / "kv")
    with caplog.at_level(logging.ERROR, "kvmesh.disk"):
        tier.write_behind((None, BlockHash(7)), _block(7))
        tier.flush()
    assert not tier.enabled and "KV disk tier off" in caplog.text
    tier.close()


def test_unusable_directory_leaves_the_tier_off(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, "kvmesh.disk"):
        tier = _open(Path("/proc/kvmesh-disk-tier"))                   # not creatable, even as root
    assert not tier.enabled and "KV disk tier off" in caplog.text
    assert tier.match_prefix(None, [BlockHash(1)]) == 0 and not tier.write_behind((None, BlockHash(1)), _block(1))


def test_second_process_on_one_directory_is_refused(tmp_path, caplog):
    first = _open(tmp_path)
    with caplog.at_level(logging.ERROR, "kvmesh.disk"):
        second = _open(tmp_path)
    assert first.enabled and not second.enabled and "another process" in caplog.text
    first.close()


_WRITER = """
import sys, torch
from kvstore.disk import DiskTier
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
shape = (8, 2, 16, 8, 64)                                  # 256 KiB blocks: writes take a while
tier = DiskTier.open(sys.argv[1], 1 << 34, KVLayout(8, 8, 64, 16, "fp32"), torch.float32, shape,
                     b"fingerprint-0001", max_queue=8)
i = 0
while True:
    i += 1
    block = torch.full(shape, float(i))
    while not tier.write_behind((None, BlockHash(i)), block):
        pass
    if i == 20:
        print("writing", flush=True)
"""


@pytest.mark.multiproc
def test_kill_9_during_write_behind_serves_no_torn_record(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.readline().strip() == b"writing"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    shape = (8, 2, 16, 8, 64)
    tier = DiskTier.open(tmp_path, 1 << 34, KVLayout(8, 8, 64, 16, "fp32"), torch.float32, shape, FP)
    assert tier.enabled and tier.num_blocks >= 1
    for h in tier.cached_hashes():                                     # every record kept reads back whole
        assert tier.read_ahead([(None, h)])
        while not (done := tier.take_reads()):
            tier.wait_reads(1.0)
        assert done[0].blocks is not None and bool((done[0].blocks == float(h)).all())
    assert tier.stats().dropped_checksum == 0
    tier.close()


@pytest.mark.slow
def test_reopen_cost(tmp_path):
    """The header scan at reopen, per 10^5 blocks (the figure in kvstore/disk.py)."""
    n = 100_000
    tier = DiskTier.open(tmp_path, n * slot_bytes(64), KVLayout(1, 1, 8, 1, "fp32"), torch.float32,
                         (1, 2, 1, 1, 8), FP, max_queue=4096)
    for i in range(1, n + 1):
        while not tier.write_behind((None, BlockHash(i)), torch.zeros(1, 2, 1, 1, 8)):
            time.sleep(0.001)
    tier.flush(600)
    tier.close()
    t0 = time.perf_counter()
    again = DiskTier.open(tmp_path, n * slot_bytes(64), KVLayout(1, 1, 8, 1, "fp32"), torch.float32,
                          (1, 2, 1, 1, 8), FP)
    seconds = time.perf_counter() - t0
    assert again.num_blocks == n
    print(f"reopen of {n} blocks: {seconds:.2f} s")
    assert seconds < 30
    again.close()


class _SlowFirstIO(SlabIO):
    """The first record's write waits until a later one's file is on disk."""

    def __init__(self) -> None:
        import threading
        super().__init__()
        self.later_done = threading.Event()
        self.first: int | None = None

    def write(self, slot, header, payload):
        if self.first is None:
            self.first = slot
            assert self.later_done.wait(10)
        super().write(slot, header, payload)
        if slot != self.first:
            self.later_done.set()


def test_two_writers_commit_in_queue_order(tmp_path):
    """Two writers write two files at once; the second block's file is finished first, yet the
    index, the events and the LRU take the blocks in the order they were queued."""
    tier = _open(tmp_path, io=_SlowFirstIO())
    assert tier._writer.writers == 2
    tier.set_event_recording(True)
    _fill(tier, range(1, 5))
    assert tier.take_events() == [BlockStored(BlockHash(i), None, 0) for i in range(1, 5)]
    assert [k[1] for k in tier._index._lru] == [1, 2, 3, 4]
    tier.check_integrity()
    tier.close()


def test_a_tier_smaller_than_its_writers_stays_in_bounds(tmp_path):
    tier = DiskTier.open(tmp_path, RECORD, LAYOUT, torch.float32, SHAPE, FP)    # one record
    _fill(tier, range(1, 9))
    assert tier.num_blocks == 1 and tier.used_bytes == RECORD and _disk_bytes(tier) == RECORD
    tier.check_integrity()
    tier.close()
