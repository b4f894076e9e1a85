"""`kvmesh bench transfer`, the disk part: the disk tier's write-behind and read-back against
plain sequential file I/O of the same bytes in the same directory, and the TTFT of a prefix
read back from disk against the same-length prompt recomputed (see `kvmesh.bench.transfer`)."""
from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

_GB = 1e9


def bench_disk(model: str, layout: Any, num_blocks: int, repeats: int, seed: int, prefix_tokens: int,
               vocab: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-disk-", dir=os.environ.get("KVMESH_BENCH_DISK_DIR")) as tmp:
        io = bench_disk_io(layout, num_blocks, repeats, seed, Path(tmp))
        ttft = bench_disk_ttft(model, prefix_tokens, seed, vocab, Path(tmp) / "ttft")
    return {**io, "ttft": ttft, "ttft_speedup": ttft["recomputed_s"] / ttft["disk_s"], "ttft_target": 10.0,
            "directory": "a temporary directory (KVMESH_BENCH_DISK_DIR, else the system's)"}


def bench_disk_io(layout: Any, num_blocks: int, repeats: int, seed: int, tmp: Path) -> dict[str, Any]:
    """`repeats` rounds (after one warm-up), each timing: `write_behind` of `num_blocks` blocks
    until the queue is drained vs one file of the same bytes written sequentially (each after
    an `os.sync`, so that neither pays for the write-back of the other's pages); one read-ahead
    of them vs that file read back sequentially into one buffer. The two sides run back to back
    in an order that alternates by round, and a round's files are deleted before the next, so
    both meet the same page cache; the ratios are the medians of the rounds' own ratios (a
    shared machine's slow moments fall on both sides of one round, not on one side's median)."""
    import torch

    from kvstore.disk import DiskTier
    from kvstore.keys import BlockHash
    from kvstore.tensors import KVTensors

    one = KVTensors(layout, 1, "meta")
    shape = (one.kv.shape[0], 2, *one.kv.shape[3:])                        # [L, 2, bs, H, D]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn(num_blocks, *shape, generator=gen).to(one.dtype)    # [n, L, 2, bs, H, D]
    nbytes = blocks.numel() * blocks.element_size()
    flat = blocks.view(torch.uint8).view(-1).numpy()
    fingerprint = bytes(16)
    keys = [(None, BlockHash(i + 1)) for i in range(num_blocks)]

    def tier_round(path: Path) -> tuple[float, float]:
        tier = DiskTier.open(path, 2 * nbytes + (1 << 20), layout, one.dtype, shape, fingerprint,
                             max_queue=num_blocks)
        os.sync()   # no dirty pages of the other side being written back
        t0 = time.perf_counter()
        for key, block in zip(keys, blocks):
            assert tier.write_behind(key, block)
        tier.flush(600)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert tier.read_ahead(keys)
        while not (done := tier.take_reads()):
            tier.wait_reads(1.0)
        read_s = time.perf_counter() - t0
        assert done[0].blocks is not None and torch.equal(done[0].blocks.movedim(2, 0), blocks)  # round trip exact
        tier.close()
        return write_s, read_s

    def raw_round(raw: Path) -> tuple[float, float]:
        os.sync()
        t0 = time.perf_counter()
        fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(flat)
        while view:
            view = view[os.write(fd, view[:1 << 24]):]
        os.close(fd)
        write_s = time.perf_counter() - t0
        out = torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        with open(raw, "rb", buffering=0) as f:
            got = f.readinto(memoryview(out.numpy()))
        read_s = time.perf_counter() - t0
        assert got == nbytes
        return write_s, read_s

    rounds = []
    for r in range(repeats + 1):
        here = tmp / f"round-{r}"
        here.mkdir()
        if r % 2:
            raw_w, raw_r = raw_round(here / "raw.bin")
            w, rd = tier_round(here / "tier")
        else:
            w, rd = tier_round(here / "tier")
            raw_w, raw_r = raw_round(here / "raw.bin")
        shutil.rmtree(here)
        rounds.append((w, rd, raw_w, raw_r))
    timed = rounds[1:]
    w, rd, rw, rr = (statistics.median(x[k] for x in timed) for k in range(4))
    return {"num_blocks": num_blocks, "num_bytes": nbytes, "block_bytes": nbytes // num_blocks, "rounds": len(timed),
            "write_behind_gb_s": nbytes / w / _GB, "read_back_gb_s": nbytes / rd / _GB,
            "raw_write_gb_s": nbytes / rw / _GB, "raw_read_gb_s": nbytes / rr / _GB,
            "write_vs_raw": statistics.median(x[2] / x[0] for x in timed),
            "read_vs_raw": statistics.median(x[3] / x[1] for x in timed),
            "write_vs_raw_rounds": [x[2] / x[0] for x in timed], "target": 0.8}


def bench_disk_ttft(model: str, prefix_tokens: int, seed: int, vocab: int, path: Path) -> dict[str, Any]:
    """One engine with a disk tier: a prompt is computed, its prefix blocks written to the disk
    tier and dropped from the device pool and the host tier; then the TTFT of that prompt (its
    prefix read back from disk, onloaded through the host tier) and of a fresh prompt of the
    same length (computed)."""
    from kvstore.keys import block_hashes
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams

    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(vocab // 4, vocab // 2) for _ in range(n)]  # noqa: E731
    prefix, suffix = tokens(prefix_tokens), tokens(16)
    eng = Engine(EngineConfig(model=model, kv_offload_gib=0.25, kv_disk_path=str(path), kv_disk_gib=4.0,
                              max_model_len=prefix_tokens + 64))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    assert eng.store.disk is not None and eng.store.host is not None
    try:
        eng.generate(tokens(32), one)                                          # warm-up
        first = eng.generate(prefix + suffix, one)[0]
        hashes = block_hashes(prefix, eng.cfg.block_size, eng.salt)
        ids = [eng.store.pool.get_cached_block(h) for h in hashes]
        data = eng.store.kv.gather_blocks([int(b) for b in ids if b is not None]).movedim(2, 0).contiguous()
        for h, row in zip(hashes, data):          # the host tier's spill path (write-through may have been first)
            while eng.store.disk.wants((None, h)) and not eng.store.disk.write_behind((None, h), row):
                time.sleep(0.001)                 # the queue is full: wait for room
        eng.store.disk.flush(600)
        eng.store.reset_prefix_cache()
        eng.store.host.clear()
        assert eng.store.lookup(hashes).num_blocks == 0 and eng.store.disk.match_prefix(None, hashes) == len(hashes)
        t0 = time.perf_counter()
        from_disk = eng.generate(prefix + suffix, one)[0]
        disk_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.generate(tokens(prefix_tokens + 16), one)
        recomputed_s = time.perf_counter() - t0
        stats = eng.store.disk.stats()
    finally:
        eng.store.close()
    return {"prefix_tokens": prefix_tokens, "prompt_tokens": prefix_tokens + 16, "disk_s": disk_s,
            "recomputed_s": recomputed_s, "disk_cached_tokens": from_disk.num_cached_tokens,
            "blocks_read": stats.read, "first_token_equal": first.token_ids == from_disk.token_ids}
