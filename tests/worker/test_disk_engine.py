"""The disk tier below the engine's host tier: a prefix evicted from the device pool and then
from host memory comes back from disk with the same greedy output as an engine without
tiers, for every KV dtype; a restarted engine on the same directory serves it from disk."""
from __future__ import annotations

import random

import pytest

from kvstore.keys import block_hashes, cache_salt_root
from kvstore.layout import KV_CACHE_DTYPES
from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import prompt_input
from worker.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model_dir, kv_cache_dtype: str, *, host_blocks: int = 0, disk_dir=None, bytes_per_block: int = 0,
            num_blocks: int = 12) -> Engine:
    tiers = {}
    if host_blocks:
        tiers = {"kv_offload_gib": host_blocks * bytes_per_block / 2**30}
    if disk_dir is not None:
        tiers |= {"kv_disk_path": str(disk_dir), "kv_disk_gib": 0.01}
    return Engine(EngineConfig(model=str(model_dir), block_size=4, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype,
                               check_integrity=True, max_model_len=64, **tiers))


def _traffic(eng: Engine, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [eng.generate(p, GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_prefix_from_disk_equals_no_tiers(tiny_model_dir, tmp_path, kv_cache_dtype):
    d = tiny_model_dir("llama-gqa")
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(24)]                      # 6 full blocks
    others = [[rng.randrange(3, 200) for _ in range(30)] for _ in range(4)]
    prompts = [shared + [7, 8], *others, shared + [7, 8]]
    plain = _engine(d, kv_cache_dtype)
    want = _traffic(plain, prompts)
    bpb = plain.layout.bytes_per_block

    eng = _engine(d, kv_cache_dtype, host_blocks=8, disk_dir=tmp_path, bytes_per_block=bpb)
    got = [eng.generate(prompts[0], GREEDY)[0].token_ids]
    for p in prompts[1:-1]:                                                   # evict `shared` to disk
        got.append(eng.generate(p, GREEDY)[0].token_ids)
        eng.store.disk.flush()
    hashes = block_hashes(shared, 4, eng.salt)
    assert eng.store.lookup(hashes).num_blocks == 0, "the prefix should have left the device and host"
    assert eng.store.disk.match_prefix(None, hashes) == 6
    last = eng.generate(prompts[-1], GREEDY)[0]
    got.append(last.token_ids)
    assert got == want
    st = eng.stats()
    assert last.num_cached_tokens == 24 and st.disk is not None and st.disk.read >= 6
    assert st.disk.dropped_checksum == 0
    if kv_cache_dtype == "auto":
        _check_metrics(st)
    eng.store.close()

    # a restart on the same directory: the prefix is served from disk at once
    again = _engine(d, kv_cache_dtype, host_blocks=8, disk_dir=tmp_path, bytes_per_block=bpb)
    assert again.store.disk.stats().reopened >= 6
    out = again.generate(prompts[-1], GREEDY)[0]
    assert out.token_ids == want[-1] and out.num_cached_tokens == 24
    again.store.close()


def _check_metrics(stats) -> None:
    from prometheus_client import generate_latest

    from worker.server.metrics import WorkerMetrics
    m = WorkerMetrics("tiny", "w-disk", "fp32")
    m.update_stats(stats, None)
    text = generate_latest(m.registry).decode()
    lv = 'model_name="tiny",worker_id="w-disk"'
    assert f"kvmesh:kv_disk_blocks_read_total{{{lv}}} {float(stats.disk.read)}" in text
    assert f"kvmesh:kv_disk_blocks_written_total{{{lv}}} {float(stats.disk.written)}" in text
    assert f'kvmesh:kv_disk_blocks_dropped_total{{cause="checksum",{lv}}} 0.0' in text
    assert f'kvmesh:kv_disk_blocks_dropped_total{{cause="queue_full",{lv}}} 0.0' in text
    assert f'kvmesh:kv_disk_read_seconds_count{{{lv}}} {float(stats.disk.read_seconds.count)}' in text
    assert f'kvmesh:kv_disk_write_seconds_bucket{{le="+Inf",{lv}}} {float(stats.disk.written)}' in text
    assert "kvmesh:disk_tier_usage_perc{" in text


def test_salted_prefix_on_disk_is_found_only_under_its_salt(tiny_model_dir, tmp_path):
    d = tiny_model_dir("llama-gqa")
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(24)]
    plain = _engine(d, "auto")
    eng = _engine(d, "auto", host_blocks=8, disk_dir=tmp_path, bytes_per_block=plain.layout.bytes_per_block)

    def run(salt: str) -> int:
        eng.add_request(prompt_input(shared + [9], GREEDY, cache_salt=salt))
        cached = 0
        while eng.has_unfinished():
            for out in eng.step():
                cached = out.num_cached_tokens
        return cached

    assert run("tenant-a") == 0
    for _ in range(4):
        eng.generate([rng.randrange(3, 200) for _ in range(30)], GREEDY)
        eng.store.disk.flush()
    root = cache_salt_root("tenant-a")
    hashes = block_hashes(shared, 4, eng.salt, root)
    assert eng.store.lookup(hashes, root).num_blocks == 0
    assert eng.store.disk.match_prefix(root, hashes) == 6
    assert eng.store.disk.match_prefix(None, hashes) == 0          # the key includes the salt root
    assert eng.store.disk.match_prefix(cache_salt_root("tenant-b"), hashes) == 0
    assert run("tenant-b") == 0                                     # another tenant: nothing from disk
    assert run("tenant-a") == 24                                    # its own tenant: all 6 blocks
    eng.store.close()


def test_disk_flags_go_together():
    with pytest.raises(ValueError, match="kv_disk_path"):
        EngineConfig(kv_disk_gib=1.0, kv_offload_gib=1.0)
    with pytest.raises(ValueError, match="kv_disk_path"):
        EngineConfig(kv_disk_path="/tmp/x", kv_offload_gib=1.0)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineConfig(kv_disk_path="/tmp/x", kv_disk_gib=1.0)
