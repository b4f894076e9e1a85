"""The disk tier's slots: a slot being read is not rewritten until the read ends, writers are
spread over the slab files, and a reopen keeps a key's latest record when two slots hold it."""
from __future__ import annotations

import threading

import torch

from kvstore.disk import DiskTier
from kvstore.disk_record import SLAB_FILES, SlabIO, encode_header, slot_bytes
from kvstore.disk_slots import SlotTable
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout

LAYOUT = KVLayout(2, 2, 8, 4, "fp32")
SHAPE = (2, 2, 4, 2, 8)
RECORD = slot_bytes(LAYOUT.bytes_per_block)
FP = b"fingerprint-0007"


def _block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def _fill(tier: DiskTier, ids: range) -> None:
    for i in ids:
        assert tier.write_behind((None, BlockHash(i)), _block(i))
    tier.flush()


def test_slot_table_spreads_writers_and_holds_a_read_slot() -> None:
    t = SlotTable(4, 2, used=[0])
    a = t.take()
    b = t.take()
    assert {a % 2, b % 2} == {0, 1}                       # two writers, two files
    left = t.num_free()
    t.written(a)
    t.pin(a)
    t.free(a)                                             # evicted while read: not free yet
    assert t.num_free() == left
    t.unpin(a)
    assert t.num_free() == left + 1
    t.check_integrity([0, b], 4)


class _SlowRead(SlabIO):
    def __init__(self) -> None:
        super().__init__()
        self.reading, self.go = threading.Event(), threading.Event()

    def read_into(self, slot, header, payload):
        self.reading.set()
        assert self.go.wait(10)
        return super().read_into(slot, header, payload)


def test_a_slot_being_read_is_not_rewritten_until_the_read_ends(tmp_path) -> None:
    io = _SlowRead()
    tier = DiskTier.open(tmp_path, RECORD, LAYOUT, torch.float32, SHAPE, FP, io=io)   # one slot
    _fill(tier, range(1, 2))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(tier.read_now([(None, BlockHash(1))])))
    reader.start()
    assert io.reading.wait(10)
    assert tier.write_behind((None, BlockHash(2)), _block(2))   # evicts 1; its slot is still read
    tier.flush()
    assert tier.num_blocks == 0 and tier.stats().dropped_queue_full == 1
    io.go.set()
    reader.join(10)
    (keys, blocks), = got
    assert keys == ((None, BlockHash(1)),) and bool((blocks == 1.0).all())   # read whole, not overwritten
    _fill(tier, range(3, 4))                                    # the slot is free again
    assert tier.num_blocks == 1 and tier.stats().dropped_checksum == 0
    tier.check_integrity()
    tier.close()


def test_reopen_keeps_the_later_of_two_records_of_one_key(tmp_path) -> None:
    tier = DiskTier.open(tmp_path, 4 * RECORD, LAYOUT, torch.float32, SHAPE, FP)
    _fill(tier, range(1, 2))
    first = tier.record_location((None, BlockHash(1)))
    tier.close()
    io = SlabIO()                                         # a later write of key 1 in another slot
    io.open(tier.dir, 4, RECORD)
    io.resize()
    newer = _block(5)
    payload = newer.view(torch.uint8).numpy().data.cast("B")
    other = next(s for s in range(4) if io.location(s) != first)
    io.write(other, encode_header(FP, (None, BlockHash(1)), payload, 99), payload)
    io.close()
    again = DiskTier.open(tmp_path, 4 * RECORD, LAYOUT, torch.float32, SHAPE, FP)
    assert again.num_blocks == 1 and again.record_location((None, BlockHash(1))) == io.location(other)
    (_, blocks) = again.read_now([(None, BlockHash(1))])
    assert blocks is not None and bool((blocks == 5.0).all())
    _fill(again, range(2, 5))                             # the older record's slot is free for new writes
    assert again.num_blocks == 4 and again.stats().evicted == 0
    again.check_integrity()
    again.close()


def test_writes_land_in_both_slab_files(tmp_path) -> None:
    tier = DiskTier.open(tmp_path, 16 * RECORD, LAYOUT, torch.float32, SHAPE, FP)
    _fill(tier, range(1, 17))
    files = {loc[0] for i in range(1, 17) if (loc := tier.record_location((None, BlockHash(i)))) is not None}
    assert len(files) == SLAB_FILES
    tier.close()
