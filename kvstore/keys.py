"""Block hashing: the one content key of a KV block, shared by router and worker.

A block's hash covers the salt (model, tokenizer, KV dtype, block size, codec parameters), the hash of the
block before it (so equal tokens after different prefixes get different keys) and the
block's own token ids. It is blake2b with a 16-byte digest over a fixed byte layout, so
it is the same in every process and on every machine: no Python `hash()`, no dependence
on PYTHONHASHSEED. Only FULL blocks are hashed; a trailing partial block has no key.

Byte layout fed to blake2b(digest_size=16) — changing any of it changes every key:

    salt length (u32 little-endian) ‖ salt
    ‖ b"R" (no parent) | b"P" ‖ parent (16 bytes, big-endian)
    ‖ token ids, each u32 little-endian

A `BlockHash` is that digest read as a big-endian 128-bit int; `block_hash_hex` gives
back the digest's 32 hex characters.

A request's `cache_salt` (vLLM's name; tenant isolation) enters the FIRST block's
hash: `cache_salt_root` turns it into a virtual parent (blake2b over a version tag and the
length-prefixed utf-8 salt), passed as `parent` to `block_hashes`, so the first block is
keyed ``… ‖ b"P" ‖ root ‖ tokens`` and every block after it differs from the unsalted chain
and from any other salt's. The empty salt has no root: those keys are unchanged.

This module imports no torch: the router uses it directly.
"""
from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", int)

_HASH_BYTES = 16
_HASH_LIMIT = 1 << (8 * _HASH_BYTES)
_TOKEN_LIMIT = 1 << 32
_ROOT_MARKER = b"R"
_PARENT_MARKER = b"P"
_SALT_VERSION = b"kvmesh-salt-v1"
_CACHE_SALT_VERSION = b"kvmesh-cache-salt-v1"


def block_hash_hex(h: BlockHash) -> str:
    """The 32 lowercase hex characters of a block hash (the blake2b hexdigest)."""
    if not 0 <= h < _HASH_LIMIT:
        raise ValueError(f"block hash {h!r} is not a 128-bit unsigned int")
    return f"{h:032x}"


def block_hash_from_hex(s: str) -> BlockHash:
    """Inverse of `block_hash_hex`: exactly 32 hex characters."""
    if len(s) != 2 * _HASH_BYTES:
        raise ValueError(f"block hash hex {s!r} must be {2 * _HASH_BYTES} characters")
    try:
        return BlockHash(int(s, 16))
    except ValueError:
        raise ValueError(f"block hash hex {s!r} is not hexadecimal") from None


@dataclass(frozen=True, slots=True)
class HashSalt:
    """What, besides tokens, decides whether two KV blocks are interchangeable."""

    model: str
    tokenizer: str
    kv_cache_dtype: str
    block_size: int
    kv_codec: str = ""  # anything else that changes the stored bytes (int4 key scales); "" = none

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "kv_cache_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}={value!r} must be a non-empty string")
        if not isinstance(self.kv_codec, str):
            raise ValueError(f"kv_codec={self.kv_codec!r} must be a string")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size!r} must be a positive integer")

    def digest(self) -> bytes:
        """16 stable bytes: blake2b over a version tag and the length-prefixed utf-8 fields."""
        h = hashlib.blake2b(digest_size=_HASH_BYTES)
        h.update(_SALT_VERSION)
        fields = [self.model, self.tokenizer, self.kv_cache_dtype, str(self.block_size)]
        if self.kv_codec:  # absent when empty: salts from before the field existed are unchanged
            fields.append(self.kv_codec)
        for field in fields:
            raw = field.encode("utf-8")
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        return h.digest()


def cache_salt_root(cache_salt: str) -> BlockHash | None:
    """The virtual parent of the first block of a request salted with `cache_salt`; None for
    "" (no salt). The one definition for router and worker: pass it as `parent`."""
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt={cache_salt!r} must be a string")
    if not cache_salt:
        return None
    raw = cache_salt.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(_CACHE_SALT_VERSION)
    h.update(struct.pack("<I", len(raw)))
    h.update(raw)
    return BlockHash(int.from_bytes(h.digest(), "big"))


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        for i, t in enumerate(token_ids):
            if not hasattr(t, "__index__"):
                raise ValueError(f"token_ids[{i}]={t!r} is not an integer") from None
            if not 0 <= operator.index(t) < _TOKEN_LIMIT:
                raise ValueError(f"token_ids[{i}]={t!r} is outside [0, 2**32)") from None
        raise


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    """Key of one block of `token_ids` that follows the block keyed `parent` (None: first)."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(struct.pack("<I", len(salt)))
    h.update(salt)
    if parent is None:
        h.update(_ROOT_MARKER)
    else:
        if not 0 <= parent < _HASH_LIMIT:
            raise ValueError(f"parent={parent!r} is not a 128-bit unsigned int")
        h.update(_PARENT_MARKER)
        h.update(parent.to_bytes(_HASH_BYTES, "big"))
    h.update(_pack_tokens(token_ids))
    return BlockHash(int.from_bytes(h.digest(), "big"))


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes,
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained keys of the FULL blocks of `token_ids`; `parent` keys the block before them."""
    _check_block_size(block_size)
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], salt)
        out.append(parent)
    return out


def extend_block_hashes(existing: Sequence[BlockHash], token_ids: Sequence[int],
                        block_size: int, salt: bytes,
                        parent: BlockHash | None = None) -> list[BlockHash]:
    """`existing` plus the keys of the blocks completed since — hashing only the new ones.

    `token_ids` are ALL tokens of the sequence so far; `existing` the keys already known
    for its first full blocks (as returned by `block_hashes` with the same `parent`).
    Returns a new list equal to `block_hashes(token_ids, block_size, salt, parent)`.
    """
    _check_block_size(block_size)
    num_done = len(existing)
    if num_done > len(token_ids) // block_size:
        raise ValueError(f"{num_done} existing hashes but only {len(token_ids)} tokens "
                         f"({len(token_ids) // block_size} full blocks of {block_size})")
    last = existing[-1] if existing else parent
    return [*existing, *block_hashes(token_ids[num_done * block_size:], block_size, salt, last)]
