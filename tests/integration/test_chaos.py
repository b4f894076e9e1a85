"""Chaos under load on one `kvmesh serve --workers 2` (real processes, all on
127.0.0.1): kill -9 a worker under 24 concurrent greedy streams (they migrate: no client sees an
error, every output equals the fault-free run), kill -9 Redis under load (nothing fails, the
index resyncs), SIGTERM a worker under load (its streams finish, nothing new reaches it).

The baseline is measured in the same run: each prompt once through the same cluster before any
fault. Greedy outputs may part from it only at a near-tie (docs/ARCHITECTURE.md), checked with
HF transformers as the oracle when they do.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.bench.chaos_harness import Outcome, ServeProcess, run_streams, wait_until, workers_up
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.oracle import assert_outcomes_equal_or_near_tie

pytestmark = pytest.mark.multiproc

PROMPTS = ["The history of the lighthouse begins", "A recipe for bread needs", "The three laws of motion say",
           "In a small village by the sea,", "The best way to learn a language is", "Rivers of Europe include",
           "A paged KV cache works by", "The chess opening called the Sicilian"]
MAX_TOKENS = 64      # long enough that a kill lands mid-stream on a quiet machine too (20 did not)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(2, tmp_path_factory.mktemp("chaos"))      # kv_aware routing, restart on-failure
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def baseline(serve: ServeProcess) -> dict[int, Outcome]:
    outs = asyncio.run(run_streams(serve.grpc_target, PROMPTS, MAX_TOKENS, 120, list(range(len(PROMPTS)))))
    assert all(o.ok and len(o.tokens) == MAX_TOKENS for o in outs), outs
    return {o.prompt: o for o in outs}


def _running(serve: ServeProcess, i: int) -> int:
    with grpc.insecure_channel(serve.worker_addresses[i]) as ch:
        load = pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10, metadata=serve.worker_metadata)
    return load.num_running + load.num_waiting


def _in_background(serve: ServeProcess, order: list[int]) -> tuple[threading.Thread, list[Outcome]]:
    results: list[Outcome] = []
    thread = threading.Thread(target=lambda: results.extend(
        asyncio.run(run_streams(serve.grpc_target, PROMPTS, MAX_TOKENS, 180, order))), daemon=True)
    thread.start()
    return thread, results


def test_kill9_worker_under_24_streams_migrates_them(serve: ServeProcess, baseline: dict[int, Outcome],
                                                     smollm2_dir: Path) -> None:
    thread, outcomes = _in_background(serve, [i % len(PROMPTS) for i in range(24)])
    assert wait_until(lambda: _running(serve, 0) >= 4, 60) is not None
    time.sleep(0.4)     # let its streams send some tokens (not all 64)
    pid = serve.kill("worker-0")
    killed_at = time.monotonic()
    thread.join(240)
    assert not thread.is_alive() and len(outcomes) == 24
    assert [o for o in outcomes if not o.ok] == []                      # 0 client-visible errors
    migrated = [o for o in outcomes if o.migrations]
    assert migrated and {o.worker_id for o in migrated} == {"worker-1"}
    assert all(len(o.tokens) == MAX_TOKENS for o in outcomes)
    assert_outcomes_equal_or_near_tie(outcomes, baseline, PROMPTS, smollm2_dir)
    back = wait_until(lambda: serve.pid("worker-0") != pid and workers_up(serve.http_base).get("worker-0"), 120)
    assert back is not None, serve.err.read_text()[-3000:]
    print(f"{len(migrated)} of 24 streams migrated; worker-0 back in routing "
          f"{time.monotonic() - killed_at:.1f} s after kill -9")
    router_log = (serve.log_dir / "children" / "router.log").read_text()
    assert "migrating off worker worker-0" in router_log


def test_kill9_redis_under_load_fails_nothing_and_the_index_resyncs(serve: ServeProcess,
                                                                   baseline: dict[int, Outcome]) -> None:
    assert wait_until(lambda: all(workers_up(serve.http_base).values()) and len(workers_up(serve.http_base)) == 2,
                      120) is not None
    thread, outcomes = _in_background(serve, [i % len(PROMPTS) for i in range(8)])
    time.sleep(0.5)
    serve.kill("redis")
    thread.join(240)
    assert len(outcomes) == 8 and [o for o in outcomes if not o.ok] == []
    assert wait_until(lambda: serve.restarts("redis") >= 1, 60) is not None
    # resynced: the block index (fed through the new Redis) predicts the hit of a shared prefix
    shared = "You are a careful assistant who answers questions about rivers in one sentence. " * 3
    req = pb.GenerateRequest(text=shared + "Which river flows through Paris?",
                             sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
    with grpc.insecure_channel(serve.grpc_target) as ch:
        stub = pb_grpc.RouterStub(ch)
        first = list(stub.Generate(req, timeout=60))[-1]
        predicted = _predicted_hits(serve)
        assert wait_until(lambda: _index_holds(serve, stub, req, predicted), 30, poll_s=1.0) is not None
    assert first.finished


def _predicted_hits(serve: ServeProcess) -> float:
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(serve.http_base.removesuffix("/v1") + "/metrics", timeout=10) as r:
        body = r.read().decode()
    line = next(x for x in body.splitlines() if x.startswith("kvmesh:router_predicted_hit_tokens_total "))
    return float(line.split()[1])


def _index_holds(serve: ServeProcess, stub: pb_grpc.RouterStub, req: pb.GenerateRequest, before: float) -> bool:
    """The same request again is predicted to hit (the index knows its holder) and does hit."""
    last = list(stub.Generate(req, timeout=60))[-1]
    return _predicted_hits(serve) > before and last.cached_tokens > 0


def test_sigterm_worker_under_load_finishes_its_streams(serve: ServeProcess) -> None:
    assert wait_until(lambda: len([u for u in workers_up(serve.http_base).values() if u]) == 2, 120) is not None
    thread, outcomes = _in_background(serve, [i % len(PROMPTS) for i in range(8)])
    assert wait_until(lambda: _running(serve, 1) >= 2, 60) is not None
    serve.kill("worker-1", signal.SIGTERM)
    thread.join(240)
    assert len(outcomes) == 8 and [o for o in outcomes if not o.ok] == []
    assert all(len(o.tokens) == MAX_TOKENS for o in outcomes)
    assert not any(o.migrations for o in outcomes)      # drained, not migrated
    assert wait_until(lambda: "worker-1 exited cleanly" in serve.err.read_text(), 60) is not None
    after = asyncio.run(run_streams(serve.grpc_target, PROMPTS, 4, 60, [0, 1, 2, 3]))
    assert all(o.ok and o.worker_id == "worker-0" for o in after), after


def test_sigterm_router_turns_unready_at_once_and_finishes_open_streams(serve: ServeProcess) -> None:
    """Router drain (runs last: a router that exits 0 is not restarted under on-failure)."""
    import urllib.error
    import urllib.request
    thread, outcomes = _in_background(serve, [0, 1])
    # both streams open, on whichever workers the policy chose (one was SIGTERMed earlier: it stays down)

    def running_anywhere() -> int:
        total = 0
        for i in range(2):
            with contextlib.suppress(grpc.RpcError):
                total += _running(serve, i)
        return total
    assert wait_until(lambda: running_anywhere() >= 2, 60) is not None
    pid = serve.kill("router", signal.SIGTERM)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as err:
        opener.open(serve.http_base.removesuffix("/v1") + "/health", timeout=5)
    assert err.value.code == 503
    thread.join(240)
    assert len(outcomes) == 2 and all(o.ok and len(o.tokens) == MAX_TOKENS for o in outcomes), outcomes
    assert wait_until(lambda: "router exited cleanly" in serve.err.read_text(), 60) is not None
    assert f"router (pid {pid}) exited with code 0" in serve.err.read_text()
