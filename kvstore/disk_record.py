"""The disk tier's records: slot layout, the header and checksum codec, and the file-system edge.

Layout on disk: the records live in slots of `SLAB_FILES` preallocated slab files, each slot one
record (`slot_bytes`: the header and the block's bytes, rounded up to whole 4 KiB pages):

    DIR/v2-<fingerprint: 32 hex>/slab-0.kvs, slab-1.kvs   slot s in slab s % 2, at (s // 2) x slot bytes
    DIR/v2-<fingerprint>/lock                            flock'ed by the process using the tier

Slots in a few large files rather than one file per block: creating, renaming and closing a
file per block cost ~100 us each on ext4 (more than copying the block into the page cache), and
made the write-behind 0.6-0.7x a plain sequential write of the same bytes (`kvmesh bench
transfer`); a slot is rewritten in place with two pwrite(2)s. One slab per writer thread (two):
buffered writes to one file take its inode lock, so two writers keep two slabs busy. The LRU
evicts a block by freeing its slot (nothing is written); the slot's next record overwrites it.

A record is written in two steps: the slot's pages whole with a zeroed header (no page is ever
half-written, so nothing is read back first), then the header. A process killed between the two
leaves an empty slot, never a header over a torn payload. A reopen reads each slot's header only
(`scan_slots`); a slot whose record was evicted but not yet overwritten comes back with it (a
valid block; a key found in two slots keeps the later write). The LRU order after a reopen is
the records' write sequence numbers (hits are not recorded on disk: no metadata write on a read).

Each record's header (88 bytes):

    magic b"KVMB" | format version u16 | flags u16 (bit 0: salted) | fingerprint 16 B
    | block hash 16 B | salt root 16 B | payload length u64 | write sequence u64
    | checksum u64 | header checksum u64

The checksum is xxh3-64 over the 72 bytes before it and the payload; the header checksum is
xxh3-64 over the 80 bytes before it, so a reopen trusts a header without reading its payload.
The fingerprint is the caller's digest of the model, the KV layout and the KV dtype
(`fingerprint_of`): records of another fingerprint live in another directory and are never
read. The salt root (`kvstore.keys.cache_salt_root` of the request's cache_salt) is part of
the key, and a read checks the header's root, hash and fingerprint as well as both checksums.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvstore.keys import BlockHash
from kvstore.layout import KVLayout

FORMAT_VERSION = 2
_MAGIC = b"KVMB"
HEAD = struct.Struct("<4sHH16s16s16sQQ")      # everything the checksum covers before the payload
_SUM = struct.Struct("<Q")
HEADER_BYTES = HEAD.size + 2 * _SUM.size       # 88
_ZERO_HEADER = bytes(HEADER_BYTES)
_PAGE = 4096
SLAB_FILES = 2
_SALTED = 1

DiskKey = tuple[BlockHash | None, BlockHash]   # (salt root, block hash)

log = logging.getLogger("kvmesh.disk")


class DiskSpec(NamedTuple):
    """What a `KVStore` opens its disk tier from: a directory, a size bound (bytes of
    records) and the fingerprint of the blocks it may hold (`fingerprint_of`). With
    `write_through` every block the device pool caches is queued for the disk tier at once
    (behind the engine thread all the same), not only when the host tier drops it: a worker
    killed with -9 then finds its prefixes on disk at restart, but for the writes still queued."""

    path: str
    num_bytes: int
    fingerprint: bytes
    write_through: bool = False


def fingerprint_of(salt: bytes, layout: KVLayout) -> bytes:
    """16 bytes naming what makes two workers' blocks interchangeable: the hash salt (model,
    tokenizer, KV dtype, block size, codec) and the KV layout (layers, heads, head dim, dtype)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvmesh-disk-v1")
    h.update(salt)
    h.update(repr((layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
                   layout.kv_cache_dtype, layout.bytes_per_block)).encode())
    return h.digest()


def slot_bytes(payload_bytes: int) -> int:
    """The bytes a record of `payload_bytes` takes on disk (its slot): header and payload, in whole pages."""
    return -(-(HEADER_BYTES + payload_bytes) // _PAGE) * _PAGE


class RecordError(Exception):
    """A record failed a check (said how); never escapes the tier."""


def encode_header(fingerprint: bytes, key: DiskKey, payload: memoryview, seq: int) -> bytes:
    root, block_hash = key
    head = HEAD.pack(_MAGIC, FORMAT_VERSION, _SALTED if root is not None else 0, fingerprint,
                     block_hash.to_bytes(16, "big"), (root or 0).to_bytes(16, "big"), len(payload), seq)
    h = xxhash.xxh3_64(head)
    h.update(payload)
    summed = head + _SUM.pack(h.intdigest())
    return summed + _SUM.pack(xxhash.xxh3_64_intdigest(summed))


class Header(NamedTuple):
    key: DiskKey
    seq: int
    checksum: int


def parse_header(raw: bytes | bytearray, fingerprint: bytes, payload_bytes: int) -> Header | None:
    """The header's fields after every check on them; None for an empty slot (no magic);
    raises `RecordError` for a header that is torn, corrupted or of another layout."""
    magic, version, flags, fp, block_hash, root, length, seq = HEAD.unpack_from(raw)
    if magic != _MAGIC:
        return None
    summed = HEADER_BYTES - _SUM.size
    if xxhash.xxh3_64_intdigest(memoryview(raw)[:summed]) != _SUM.unpack_from(raw, summed)[0]:
        raise RecordError("header checksum mismatch")
    if version != FORMAT_VERSION or fp != fingerprint:
        raise RecordError(f"version {version} or fingerprint differs")
    if length != payload_bytes:
        raise RecordError(f"payload of {length} bytes, want {payload_bytes}")
    salted_root = BlockHash(int.from_bytes(root, "big")) if flags & _SALTED else None
    return Header((salted_root, BlockHash(int.from_bytes(block_hash, "big"))), seq,
                  int(_SUM.unpack_from(raw, HEAD.size)[0]))


def read_record(io: SlabIO, slot: int, header: bytearray, payload: memoryview, fingerprint: bytes,
                key: DiskKey) -> None:
    """Fill `header` and `payload` from `slot`; raises `RecordError` when a check fails (size,
    header fields and checksum, the key, the payload's checksum) and OSError when the read does."""
    size = io.read_into(slot, header, payload)
    if size != HEADER_BYTES + len(payload):
        raise RecordError(f"record of {size} bytes, want {HEADER_BYTES + len(payload)}")
    got = parse_header(header, fingerprint, len(payload))
    if got is None:
        raise RecordError("empty slot")
    if got.key != key:
        raise RecordError("block hash or salt root differs from the index's")
    h = xxhash.xxh3_64(memoryview(header)[:HEAD.size])
    h.update(payload)
    if h.intdigest() != got.checksum:
        raise RecordError("checksum mismatch")


def scan_slots(io: SlabIO, fingerprint: bytes, payload_bytes: int,
               count_bad: Callable[[], None]) -> list[tuple[DiskKey, int, int]]:
    """(key, slot, write sequence) of each valid record's slot, in write order, from the headers
    only; a key in two slots keeps the later write. A slot that fails a check is counted with
    `count_bad` and its header erased; OSError from the scan propagates."""
    found: dict[DiskKey, tuple[int, int]] = {}
    header = bytearray(HEADER_BYTES)
    for slot in range(io.num_slots):
        try:
            n = io.read_header(slot, header)
            if n == 0:
                continue                                    # past the end of its file: empty
            if n != HEADER_BYTES:
                raise RecordError("header cut short")
            got = parse_header(header, fingerprint, payload_bytes)
            if got is not None and not io.whole(slot):
                raise RecordError("record cut short")
        except RecordError as e:   # in this fingerprint's directory: torn or corrupted
            count_bad()
            log.debug("dropping disk slot %d: %s", slot, e)
            io.erase(slot)
            continue
        if got is None:
            continue
        seen = found.get(got.key)
        if seen is None or seen[0] < got.seq:
            found[got.key] = (got.seq, slot)
    return sorted(((key, slot, seq) for key, (seq, slot) in found.items()), key=lambda f: f[2])


def lock_dir(directory: Path) -> int:
    """Create `directory` and hold its lock file (flock, released when the process exits,
    kill -9 included); OSError when it cannot be made or another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise OSError(errno.EBUSY, f"another process uses this directory ({e.strerror})") from None
    return fd


class SlabIO:
    """The tier's edge to the file system: `num_slots` slots of `slot_bytes` in `SLAB_FILES`
    files under a directory (tests swap in one that fails like a full disk). Slot calls may
    come from several threads at once (pread/pwrite: no shared file offset)."""

    def __init__(self) -> None:
        self.num_slots = 0
        self.slot_bytes = 0
        self._fds: list[int] = []
        self._sizes: list[int] = []
        self.paths: list[str] = []

    def open(self, directory: Path, num_slots: int, slot_bytes: int) -> None:
        """Open (create) the slab files for `num_slots` slots; `resize` sizes them after the scan."""
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.paths = [str(directory / f"slab-{k}.kvs") for k in range(SLAB_FILES)]
        self._fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in self.paths]
        self._sizes = [os.fstat(fd).st_size for fd in self._fds]

    def whole(self, slot: int) -> bool:
        """Whether the file holds all of `slot`'s bytes (a file cut short does not)."""
        return (slot // SLAB_FILES + 1) * self.slot_bytes <= self._sizes[slot % SLAB_FILES]

    def resize(self) -> None:
        """Size the files for `num_slots` slots (sparse: disk space is taken as records are
        written); records past the end of a smaller tier are cut off."""
        for k, fd in enumerate(self._fds):
            self._sizes[k] = (self.num_slots - k + SLAB_FILES - 1) // SLAB_FILES * self.slot_bytes
            os.ftruncate(fd, self._sizes[k])

    def location(self, slot: int) -> tuple[str, int]:
        """The file and byte offset of `slot`."""
        return self.paths[slot % SLAB_FILES], (slot // SLAB_FILES) * self.slot_bytes

    def write(self, slot: int, header: bytes, payload: memoryview) -> None:
        fd, off = self._fds[slot % SLAB_FILES], (slot // SLAB_FILES) * self.slot_bytes
        pad = self.slot_bytes - HEADER_BYTES - len(payload)
        _pwrite_all(fd, [_ZERO_HEADER, payload, bytes(pad)], off)   # whole pages, no header yet
        _pwrite_all(fd, [header], off)
        if os.fstat(fd).st_nlink == 0:
            raise OSError(errno.ENOENT, "the tier's slab file was deleted", self.paths[slot % SLAB_FILES])

    def read_into(self, slot: int, header: bytearray, payload: memoryview) -> int:
        """Fill `header` then `payload` from `slot`; returns the bytes read (short: cut short)."""
        return os.preadv(self._fds[slot % SLAB_FILES], [header, payload], (slot // SLAB_FILES) * self.slot_bytes)

    def read_header(self, slot: int, header: bytearray) -> int:
        return os.preadv(self._fds[slot % SLAB_FILES], [header], (slot // SLAB_FILES) * self.slot_bytes)

    def erase(self, slot: int) -> None:
        """Zero `slot`'s header: an empty slot."""
        try:
            _pwrite_all(self._fds[slot % SLAB_FILES], [_ZERO_HEADER], (slot // SLAB_FILES) * self.slot_bytes)
        except OSError:
            pass   # the record already failed a check: the index has dropped it either way

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _pwrite_all(fd: int, parts: Sequence[bytes | memoryview], offset: int) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    written = os.pwritev(fd, views, offset)   # one call; a short write goes on part by part
    offset += written
    for view in views:
        skip = min(written, len(view))
        written -= skip
        view = view[skip:]
        while view:
            n = os.pwrite(fd, view, offset)
            offset += n
            view = view[n:]
