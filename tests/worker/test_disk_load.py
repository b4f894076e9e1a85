"""GetLoad's disk figures, which the router prices a disk-held prefix by: the tier's measured read
speed and `disk_read_cost_ratio` (a block's read over its prefill at the worker's measured rate)."""
from __future__ import annotations

from typing import Any

import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.loop_thread import LoopThread
from tests.worker.test_server import request, serving, tiny_cfg
from worker.engine.commands import ResetPrefixCache
from worker.server.responses import disk_read_cost_ratio


def test_the_ratio_is_a_blocks_read_over_its_prefill_and_zero_while_unmeasured() -> None:
    # 1 MB at 1 GB/s = 1 ms against 16 tokens at 4,000 tokens/s = 4 ms
    assert disk_read_cost_ratio(1_000_000, 1e9, 16, 4000.0) == pytest.approx(0.25)
    assert disk_read_cost_ratio(1_000_000, 0.0, 16, 4000.0) == 0.0
    assert disk_read_cost_ratio(1_000_000, 1e9, 16, 0.0) == 0.0


def test_get_load_reports_the_disk_read_cost_once_a_prefix_was_read_back(loop: LoopThread, tiny_model_dir: Any,
                                                                        tmp_path: Any) -> None:
    cfg = tiny_cfg(tiny_model_dir, kv_offload_gib=0.001, kv_disk_path=str(tmp_path / "disk"), kv_disk_gib=0.01,
                   max_model_len=128)
    prompt = list(range(10, 74))                                   # 16 blocks of 4
    with serving(loop, cfg, worker_id="w-disk") as (server, channel):
        stub = pb_grpc.WorkerStub(channel)
        assert server._prefill_tokens_s > 0                        # the start-up probe (no peer plane)
        load = stub.GetLoad(pb.LoadRequest())
        assert load.disk_read_bytes_s == 0 and load.disk_read_cost_ratio == 0      # nothing read yet
        first = list(stub.Generate(request(prompt, max_tokens=1, temperature=0.0)))
        engine = server._engine
        assert engine is not None and engine.store.disk is not None
        engine.store.disk.flush(30)                                # written through
        assert loop.run(server._ae.run(ResetPrefixCache()))
        assert engine.store.host is not None
        engine.store.host.clear()                                  # the engine is idle: on disk only now
        again = list(stub.Generate(request(prompt, max_tokens=1, temperature=0.0)))
        assert again[-1].cached_tokens >= 60 and again[-1].token_ids == first[-1].token_ids   # read back from disk
        load = stub.GetLoad(pb.LoadRequest())
        disk = engine.store.disk
        assert load.disk_read_bytes_s > 0
        assert load.disk_read_cost_ratio == pytest.approx(disk_read_cost_ratio(
            disk.payload_bytes, load.disk_read_bytes_s, engine.cfg.block_size, server._prefill_tokens_s))
        assert load.disk_read_cost_ratio > 0
