"""Block hashing: chaining, salting, full blocks only, stability across processes."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import (
    BlockHash,
    HashSalt,
    block_hash_from_hex,
    block_hash_hex,
    block_hashes,
    extend_block_hashes,
    hash_block,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SALT = HashSalt("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", "fp16", 16)
TOKENS = list(range(100, 140))  # 2 full blocks of 16 and a partial block of 8

# Pinned known answers: if one of these changes, every cached block key changes with it
# (router and worker must be upgraded together). Update only on purpose.
PINNED_SALT_DIGEST = "b34c2997d7695fccfe417edfbf3a9502"
PINNED_HASHES = ["f3d32d359f57bbf527c803a8067a4df8", "d5e4becea36467f89dc323921285c732"]


def test_hash_matches_documented_byte_layout() -> None:
    salt = SALT.digest()
    parent = hash_block(None, TOKENS[:16], salt)
    raw = (struct.pack("<I", len(salt)) + salt + b"P" + parent.to_bytes(16, "big")
           + struct.pack("<16I", *TOKENS[16:32]))
    expected = int.from_bytes(hashlib.blake2b(raw, digest_size=16).digest(), "big")
    assert hash_block(parent, TOKENS[16:32], salt) == expected
    root_raw = struct.pack("<I", len(salt)) + salt + b"R" + struct.pack("<16I", *TOKENS[:16])
    assert parent == int.from_bytes(hashlib.blake2b(root_raw, digest_size=16).digest(), "big")


def test_pinned_known_answer() -> None:
    assert SALT.digest().hex() == PINNED_SALT_DIGEST
    assert [block_hash_hex(h) for h in block_hashes(TOKENS, 16, SALT.digest())] == PINNED_HASHES


def test_chaining_same_block_after_different_parents_differs() -> None:
    salt = SALT.digest()
    block = [7] * 16
    a = block_hashes([1] * 16 + block, 16, salt)
    b = block_hashes([2] * 16 + block, 16, salt)
    assert a[0] != b[0] and a[1] != b[1]
    assert hash_block(None, block, salt) not in (a[1], b[1])
    # a parent of 0 is not the same as no parent
    assert hash_block(BlockHash(0), block, salt) != hash_block(None, block, salt)


def test_same_content_same_hash_and_prefix_sharing() -> None:
    salt = SALT.digest()
    a = block_hashes(TOKENS[:32] + [1] * 16, 16, salt)
    b = block_hashes(TOKENS[:32] + [2] * 16, 16, salt)
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize("field,value", [("model", "other-model"), ("tokenizer", "other-tok"),
                                         ("kv_cache_dtype", "int8"), ("block_size", 32)])
def test_salt_sensitivity(field: str, value: Any) -> None:
    other = dataclasses.replace(SALT, **{field: value})
    assert other.digest() != SALT.digest()
    assert block_hashes(TOKENS, 16, other.digest()) != block_hashes(TOKENS, 16, SALT.digest())


def test_salt_fields_are_length_prefixed() -> None:
    a = HashSalt("ab", "c", "fp16", 16)
    b = HashSalt("a", "bc", "fp16", 16)
    assert a.digest() != b.digest()


@pytest.mark.parametrize("kwargs", [{"model": ""}, {"tokenizer": ""}, {"kv_cache_dtype": ""},
                                    {"block_size": 0}, {"block_size": -1}, {"model": 3}])
def test_salt_validation_names_the_field(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"model": "m", "tokenizer": "t", "kv_cache_dtype": "fp16",
                                 "block_size": 16, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        HashSalt(**fields)  # type: ignore[arg-type]


def test_partial_block_has_no_hash() -> None:
    salt = SALT.digest()
    assert len(block_hashes(TOKENS, 16, salt)) == 2
    assert block_hashes(TOKENS, 16, salt) == block_hashes(TOKENS[:32], 16, salt)
    assert block_hashes(TOKENS[:15], 16, salt) == []
    assert block_hashes([], 16, salt) == []


def test_parent_continues_the_chain() -> None:
    salt = SALT.digest()
    full = block_hashes(TOKENS, 8, salt)
    assert block_hashes(TOKENS[16:], 8, salt, parent=full[1]) == full[2:]


def test_extend_block_hashes_equals_full_recompute() -> None:
    salt = SALT.digest()
    hashes: list[BlockHash] = []
    for n in range(len(TOKENS) + 1):  # one token at a time, as in decoding
        before = hashes
        hashes = extend_block_hashes(hashes, TOKENS[:n], 4, salt)
        assert hashes[:len(before)] == before and len(hashes) == n // 4
        assert hashes == block_hashes(TOKENS[:n], 4, salt)
    full = block_hashes(TOKENS, 4, salt)
    assert extend_block_hashes(full[:2], TOKENS, 4, salt, parent=None) == full
    # only the new blocks are hashed: a wrong `existing` prefix is trusted, not recomputed
    fake = [BlockHash(1), BlockHash(2)]
    assert extend_block_hashes(fake, TOKENS[:12], 4, salt) == \
        fake + block_hashes(TOKENS[8:12], 4, salt, parent=BlockHash(2))
    with pytest.raises(ValueError, match="existing"):
        extend_block_hashes(hashes, TOKENS[:4], 4, salt)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_ids_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        hash_block(None, [0, bad], SALT.digest())


def test_token_ids_must_be_integers() -> None:
    with pytest.raises(ValueError, match="not an integer"):
        hash_block(None, [0, 1.5], SALT.digest())  # type: ignore[list-item]


def test_max_token_id_accepted() -> None:
    hash_block(None, [0, 2**32 - 1], SALT.digest())


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_validated(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, block_size, SALT.digest())


def test_hex_round_trip() -> None:
    for h in block_hashes(TOKENS, 4, SALT.digest()):
        s = block_hash_hex(h)
        assert len(s) == 32 and block_hash_from_hex(s) == h
    assert block_hash_hex(BlockHash(1)) == "0" * 31 + "1"
    for bad in ("abc", "g" * 32, "0" * 33):
        with pytest.raises(ValueError):
            block_hash_from_hex(bad)
    with pytest.raises(ValueError):
        block_hash_hex(BlockHash(2**128))


_CHILD = """
from kvstore.keys import HashSalt, block_hashes, block_hash_hex
salt = HashSalt("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", "fp16", 16)
print(",".join(block_hash_hex(h) for h in block_hashes(list(range(100, 140)), 16, salt.digest())))
"""


@pytest.mark.multiproc
def test_stable_across_processes_and_hash_seeds() -> None:
    expected = ",".join(block_hash_hex(h) for h in block_hashes(TOKENS, 16, SALT.digest()))
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=30, check=True)
        assert out.stdout.strip() == expected, f"PYTHONHASHSEED={seed}"
