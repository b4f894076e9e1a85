"""The block pool's free queue: an intrusive doubly linked list of block metadata (O(1)
append, popleft and removal from the middle). `kvstore/pool.py` keeps two of them (probation
and protected) and owns every block's fields; this module only links and unlinks."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

from kvstore.keys import BlockHash

BlockId = NewType("BlockId", int)


class Block:
    """Metadata of one block; `prev`/`next` link it into the free queue while free."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "reused", "protected", "freed_at", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.reused = False      # its cached hash was reused by a later request (`touch`)
        self.protected = False   # free, in the protected queue
        self.freed_at = 0        # the pool's allocation count when it was last freed (kvstore/pool.py)
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeQueue:
    """Intrusive doubly linked list of free blocks between two sentinels; head = LRU."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head, self._tail = Block(-1), Block(-1)  # sentinels: no None checks at ends
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None, \
            f"block {block.block_id} is already in the free queue"
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        first = self._head.next
        assert first is not None and first is not self._tail, "free queue is empty"
        self.remove(first)
        return first

    def walk(self, forward: bool, limit: int) -> list[Block]:
        """At most `limit` blocks from the head following `next` (or from the tail, `prev`)."""
        out: list[Block] = []
        end = self._tail if forward else self._head
        node = self._head.next if forward else self._tail.prev
        while node is not end and len(out) < limit:
            assert node is not None, "broken free-queue link (None before the sentinel)"
            out.append(node)
            node = node.next if forward else node.prev
        return out


def eviction_order(probation: list[Block], protected: list[Block], n: int, stale_before: int) -> list[Block]:
    """The first `n` blocks of the two free queues' heads in the order the pool evicts them
    once protection fades: a probation block first, unless the protected head is stale (freed
    at or before `stale_before`) and was freed before it; an empty probation block (no hash)
    always first. Once the probation blocks run out, the protected ones in order."""
    out: list[Block] = []
    i = j = 0
    while len(out) < n:
        p = probation[i] if i < len(probation) else None
        q = protected[j] if j < len(protected) else None
        if q is not None and (p is None or (q.freed_at <= stale_before and p.block_hash is not None
                                            and q.freed_at < p.freed_at)):
            out.append(q)
            j += 1
        elif p is not None:
            out.append(p)
            i += 1
        else:
            break
    return out
