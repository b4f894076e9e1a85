"""What peer transfer does on the engine thread (or before it starts): count and copy out the
blocks a prefix has here, attach a staging host tier, measure prefill throughput.

Everything here touches the engine's pool, KV tensors and host tier, which only the engine
thread may do (between steps no block is evicted or rewritten); `worker.peer` calls these
through `AsyncEngine.call`, or at start-up before the engine thread runs.
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvstore.keys import BlockHash
from kvstore.tiers import HostTier
from worker.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.engine import Engine


class HeldBlocks(NamedTuple):
    """The leading run of asked blocks a worker holds, copied: `[L, 2, n, bs, H, D]`."""

    num_blocks: int
    blocks: torch.Tensor | None


def count_local_blocks(engine: Engine, hashes: Sequence[BlockHash]) -> int:
    """Leading `hashes` admission would find here: the device pool's run, then the host
    tier's (a query: no ref count, LRU or hit counter changes)."""
    n = 0
    while n < len(hashes) and engine.pool.get_cached_block(hashes[n]) is not None:
        n += 1
    return n + (engine.host.match_prefix(hashes[n:]) if engine.host is not None else 0)


def take_held_blocks(engine: Engine, hashes: Sequence[BlockHash], device: torch.device) -> HeldBlocks:
    """Copy the leading run of `hashes` held in the device pool or the host tier onto `device`.
    Engine thread only: between steps no block is evicted or rewritten while it is read."""
    runs: list[tuple[bool, list[int]]] = []     # (from the device pool?, block ids | hashes)
    n = 0
    for h in hashes:
        block_id = engine.pool.get_cached_block(h)
        on_device = block_id is not None
        if not on_device and (engine.host is None or h not in engine.host):
            break
        if not runs or runs[-1][0] != on_device:
            runs.append((on_device, []))
        runs[-1][1].append(int(block_id) if on_device else h)  # type: ignore[arg-type]
        n += 1
    if n == 0:
        return HeldBlocks(0, None)
    parts = []
    for on_device, keys in runs:
        assert on_device or engine.host is not None
        data = engine.kv.gather_blocks(keys) if on_device else engine.host.read([BlockHash(k) for k in keys])
        parts.append(data.to(device))                            # [L, 2, run, bs, H, D]
    return HeldBlocks(n, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2).contiguous())


def ensure_host_tier(engine: Engine) -> HostTier:
    """The host tier fetched blocks land in: the engine's (--kv-offload-gib), else a staging
    tier attached here as the scheduler's prefix source, sized for one max_model_len prompt
    (on CPU, memory is committed only as blocks arrive; pinned on CUDA, it is committed at
    once). Call before the engine thread starts."""
    if engine.host is None:
        engine.attach_host_tier(HostTier(engine.layout, engine.layout.blocks_for(engine.max_model_len),
                                         pin_memory=engine.device.type == "cuda"))
    assert engine.host is not None
    return engine.host


def measure_prefill(engine: Engine, num_tokens: int) -> float:
    """Prefill tokens/s: a `num_tokens` prompt of random ids run to its first token, after a
    short warm-up. The engine must be idle and its thread not started; the prefix cache is
    emptied afterwards (the probe's blocks would match nothing real)."""
    n = max(1, min(num_tokens, engine.max_model_len - 2))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([rng.randrange(vocab // 4, vocab // 2) for _ in range(min(16, n))], one)
    ids = [rng.randrange(vocab // 4, vocab // 2) for _ in range(n)]
    t0 = time.perf_counter()
    engine.generate(ids, one)
    seconds = time.perf_counter() - t0
    engine.pool.reset_prefix_cache()
    return n / seconds
