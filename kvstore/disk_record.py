"""The disk tier's records: file names, the header and checksum codec, and the file-system edge.

Layout on disk, one file per block:

    DIR/v1-<fingerprint: 32 hex>/<first 2 hex of the hash>/<hash: 32 hex>-<salt root: 32 hex | 0>.kvb
    DIR/v1-<fingerprint>/lock        flock'ed by the process using the tier

One file per block rather than an append log with an index: a file is written under a
temporary name and renamed into place, so a process killed mid-write leaves at most a `.tmp`
file, which the next open deletes; the LRU evicts one block by unlinking one file (a log would
need segments and compaction to give space back in LRU order); a reopen rebuilds the LRU from
the files' mtimes, i.e. in write order (hits are not recorded on disk: no metadata write on a
read). The price is a few syscalls per block
(open, write, rename, close), small beside a block's bytes (~0.7 MB for SmolLM2 in fp32).

Each record is a 72-byte header and the block's bytes as the host tier holds them:

    magic b"KVMB" | format version u16 | flags u16 (bit 0: salted) | fingerprint 16 B
    | block hash 16 B | salt root 16 B | payload length u64 | checksum u64

The checksum is xxh3-64 over the header's first 64 bytes and the payload. The fingerprint is
the caller's digest of the model, the KV layout and the KV dtype (`fingerprint_of`): records
of another fingerprint live in another directory and are never read. The salt root
(`kvstore.keys.cache_salt_root` of the request's cache_salt) is part of the key, and a read
checks the header's root, hash and fingerprint as well as the checksum (`check_header`).
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

FORMAT_VERSION = 1
_MAGIC = b"KVMB"
HEAD = struct.Struct("<4sHH16s16s16sQ")       # everything the checksum covers before the payload
_SUM = struct.Struct("<Q")
HEADER_BYTES = HEAD.size + _SUM.size           # 72
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


class RecordError(Exception):
    """A record failed a check (said how); never escapes the tier."""


def encode_header(fingerprint: bytes, key: DiskKey, payload: memoryview) -> bytes:
    root, block_hash = key
    head = HEAD.pack(_MAGIC, FORMAT_VERSION, _SALTED if root is not None else 0, fingerprint,
                     block_hash.to_bytes(16, "big"), (root or 0).to_bytes(16, "big"), len(payload))
    h = xxhash.xxh3_64(head)
    h.update(payload)
    return head + _SUM.pack(h.intdigest())


def check_header(raw: bytes, fingerprint: bytes, key: DiskKey, payload_bytes: int) -> int:
    """The record's checksum, after checking every header field against what it must be."""
    if len(raw) < HEADER_BYTES:
        raise RecordError(f"header of {len(raw)} bytes")
    magic, version, flags, fp, block_hash, root, length = HEAD.unpack_from(raw)
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise RecordError(f"magic {magic!r} version {version}")
    if fp != fingerprint:
        raise RecordError("fingerprint")
    want_root, want_hash = key
    if int.from_bytes(block_hash, "big") != want_hash or bool(flags & _SALTED) != (want_root is not None) \
            or int.from_bytes(root, "big") != (want_root or 0):
        raise RecordError("block hash or salt root differs from the record's name")
    if length != payload_bytes:
        raise RecordError(f"payload of {length} bytes, want {payload_bytes}")
    return int(_SUM.unpack_from(raw, HEAD.size)[0])


def record_name(key: DiskKey) -> str:
    """The record's file name, `<hash: 32 hex>-<salt root: 32 hex | 0>.kvb`."""
    root, h = key
    return f"{h:032x}-{'0' if root is None else f'{root:032x}'}.kvb"


def key_of(name: str) -> DiskKey | None:
    """The key a record's file name gives (None: not a record name)."""
    if not name.endswith(".kvb") or name[32:33] != "-" or len(name) not in (69, 38):
        return None
    root = name[33:-4]
    try:
        return (None if root == "0" else BlockHash(int(root, 16))), BlockHash(int(name[:32], 16))
    except ValueError:
        return None


def read_record(io: FileIO, path: str, header: bytearray, payload: memoryview, fingerprint: bytes,
                key: DiskKey) -> None:
    """Fill `header` and `payload` from the record at `path`; raises `RecordError` when a check fails
    (size, header fields, checksum) and OSError (FileNotFoundError included) when the read does."""
    record_bytes = HEADER_BYTES + len(payload)
    size = io.read_into(path, header, payload)
    if size != record_bytes:
        raise RecordError(f"record of {size} bytes, want {record_bytes}")
    want = check_header(bytes(header), fingerprint, key, len(payload))
    h = xxhash.xxh3_64(memoryview(header)[:HEAD.size])
    h.update(payload)
    if h.intdigest() != want:
        raise RecordError("checksum mismatch")


def scan_records(directory: Path, fingerprint: bytes, payload_bytes: int, io: FileIO,
                 count_bad: Callable[[], None]) -> list[DiskKey]:
    """The keys of the valid records under `directory`, oldest mtime first, from their headers only.
    A `.tmp` file (a write cut short) is deleted; a record that fails a check is counted with
    `count_bad` and deleted; OSError from the scan propagates."""
    record_bytes = HEADER_BYTES + payload_bytes
    found: list[tuple[float, DiskKey]] = []
    header = bytearray(HEADER_BYTES)
    subdirs = sorted(e.path for e in os.scandir(directory) if e.is_dir())
    for sub in subdirs:
        for entry in os.scandir(sub):
            path = entry.path
            if path.endswith(".tmp"):               # a write cut short (the process died)
                io.unlink(path)
                continue
            key = key_of(entry.name)
            if key is None:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    n = os.readv(fd, [header])
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                if n != HEADER_BYTES or st.st_size != record_bytes:
                    raise RecordError(f"{st.st_size} bytes, want {record_bytes}")
                check_header(bytes(header), fingerprint, key, payload_bytes)
            except RecordError as e:   # in this fingerprint's directory: torn or corrupted
                count_bad()
                log.debug("dropping disk record %s: %s", path, e)
                io.unlink(path)
                continue
            found.append((st.st_mtime, key))
    found.sort(key=lambda f: f[0])
    return [key for _, key in found]


def lock_dir(directory: Path) -> int:
    """Make `directory` and take its `lock` file's flock; returns the file's descriptor (closing
    it releases the lock). Raises OSError (EBUSY when another process holds the lock)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise OSError(errno.EBUSY, f"another process uses this directory ({e.strerror})") from None
    return fd


class FileIO:
    """The tier's edge to the file system (tests swap in one that fails like a full disk)."""

    def write(self, path: str, parts: Sequence[bytes | memoryview]) -> None:
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(part).cast("B") for part in parts]
            written = os.writev(fd, views)         # one call; a short write goes on part by part
            for view in views:
                skip = min(written, len(view))
                written -= skip
                view = view[skip:]
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def read_into(self, path: str, header: bytearray, payload: memoryview) -> int:
        """Fill `header` then `payload` from the file; returns the bytes read (short: truncated)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            n = os.readv(fd, [header, payload])
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return n if size == n else -1

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
