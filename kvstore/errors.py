"""Typed errors of the KV store: what a caller of `kvstore` is expected to handle.

Invariant violations (a bug in kvmesh) are `AssertionError`s, not these.
"""
from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error a kvstore caller may need to handle."""


class OutOfBlocks(KVStoreError):
    """An allocation asked for more blocks than the pool has free. Nothing was changed."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"requested {num_requested} blocks but only {num_free} are free")
        self.num_requested = num_requested
        self.num_free = num_free

    def __reduce__(self) -> tuple[type[OutOfBlocks], tuple[int, int]]:
        # keep the exception picklable across processes (default pickling replays .args)
        return (OutOfBlocks, (self.num_requested, self.num_free))
