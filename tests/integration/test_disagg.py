"""Disaggregated serving through real processes: two `kvmesh worker --role prefill` and one
`kvmesh worker --role decode` (SmolLM2 on CPU, peer transfer over gloo) behind an in-process
router. A long prompt is computed on a prefill worker (in chunks) and its blocks handed to the
decode worker as they are stored, which streams the tokens; a short prompt skips the hop; a
prefill worker killed (SIGKILL) in the middle of the hop is replaced by the other one; one
stopped (SIGSTOP) with no other to try costs the request at most --disagg-transfer-timeout-s,
and the decode worker computes the prompt; the decode worker killed mid-stream migrates the
stream.

The oracle for every output is the decode worker computing the same prompt cold, called
directly with a cache_salt of its own (salted block hashes: nothing cached, nothing fetched).
The prefill workers' engines are held mid-hop with the test-only stall file
(KVMESH_TEST_STALL_FILE): the request is then on the prefill worker when it is killed or stopped.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.server import RouterServer
from tests.support.loop_thread import LoopThread

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
LONG = 161                 # 10 full blocks may be handed off (the last prompt token never is)
SHORT = 24
MIN_PROMPT = 64            # --disagg-min-prompt-tokens of the test's router
TIMEOUT_S = 6.0            # --disagg-transfer-timeout-s of the test's router
MAX_TOKENS = 8


class Worker(NamedTuple):
    proc: subprocess.Popen[bytes]
    worker_id: str
    address: str
    stall: Path


def _spawn(tmp: Path, worker_id: str, role: str) -> tuple[subprocess.Popen[bytes], Path]:
    out, log, stall = tmp / f"{worker_id}.out", tmp / f"{worker_id}.log", tmp / f"{worker_id}.stall"
    argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--port", "0", "--worker-id", worker_id, "--role", role,
            "--model", "smollm2", "--peer-transfer", "--metrics-port", "-1"]
    if role == "prefill":    # LONG in 3 chunks: the decode worker fetches while the prefill worker computes
        argv += ["--prefill-chunk-tokens", "64"]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "KVMESH_TEST_STALL_FILE": str(stall)}
    with open(out, "wb") as fo, open(log, "ab") as fe:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env)
    return proc, stall


def _serving(tmp: Path, worker_id: str, proc: subprocess.Popen[bytes], stall: Path,
             timeout: float = 600.0) -> Worker:
    out = tmp / f"{worker_id}.out"
    deadline = time.monotonic() + timeout
    while not (line := out.read_text(errors="replace").strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{worker_id} did not start (rc {proc.poll()}):\n"
                        f"{(tmp / f'{worker_id}.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return Worker(proc, worker_id, line.rsplit(" ", 1)[-1], stall)


class Cluster(NamedTuple):
    workers: dict[str, Worker]
    lt: LoopThread
    router: RouterServer
    grpc_port: int
    http_port: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("disagg")
    roles = {"p1": "prefill", "p2": "prefill", "d": "decode"}
    spawned = {k: _spawn(tmp, f"w-{k}", role) for k, role in roles.items()}
    lt = LoopThread()
    router = None
    try:
        workers = {k: _serving(tmp, f"w-{k}", proc, stall) for k, (proc, stall) in spawned.items()}
        cfg = RouterConfig(worker_addresses=tuple(w.address for w in workers.values()), model=str(smollm2_dir),
                           health_interval_s=0.2, disagg_min_prompt_tokens=MIN_PROMPT,
                           disagg_transfer_timeout_s=TIMEOUT_S)
        router = RouterServer(cfg)
        grpc_port, http_port = lt.run(router.start())
        assert http_port is not None
        deadline = time.monotonic() + 60
        while len(router.core.live_workers()) < 3:    # every worker probed, its role known
            assert time.monotonic() < deadline, "the router did not see all three workers"
            time.sleep(0.1)
        yield Cluster(workers, lt, router, grpc_port, http_port)
    finally:
        for proc, stall in spawned.values():
            stall.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=30)
        if router is not None:
            lt.run(router.stop(1))
        lt.close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def _request(prompt: list[int], salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), cache_salt=salt,
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


def _tokens(msgs: list[pb.GenerateResponse]) -> tuple[list[int], pb.GenerateResponse]:
    assert msgs and msgs[-1].finished
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _via_router(c: Cluster, prompt: list[int]) -> tuple[list[int], pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as ch:
        return _tokens(list(pb_grpc.RouterStub(ch).Generate(_request(prompt), timeout=300)))


def _oracle(c: Cluster, prompt: list[int], seed: int) -> list[int]:
    """The decode worker computing `prompt` cold (its own cache_salt: no block of it is cached)."""
    with grpc.insecure_channel(c.workers["d"].address) as ch:
        tokens, final = _tokens(list(pb_grpc.WorkerStub(ch).Generate(_request(prompt, f"oracle-{seed}"),
                                                                     timeout=300)))
    assert final.cached_tokens == 0
    return tokens


def _load(w: Worker) -> pb.Load:
    with grpc.insecure_channel(w.address) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=30)


def _entry(c: Cluster, w: Worker):  # type: ignore[no-untyped-def]
    return c.router.core.registry.entry(w.address)


def test_roles_are_in_the_cluster_view_and_in_get_load(cluster: Cluster) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/v1/cluster", timeout=30) as resp:
        doc = json.load(resp)
    assert {w["worker_id"]: w["role"] for w in doc["workers"]} == {"w-p1": "prefill", "w-p2": "prefill",
                                                                   "w-d": "decode"}
    assert [_load(cluster.workers[k]).role for k in ("p1", "p2", "d")] == ["prefill", "prefill", "decode"]


def test_a_long_prompt_is_prefilled_on_a_prefill_worker_and_decoded_on_the_decode_worker(cluster: Cluster) -> None:
    disagg = cluster.router.core.disagg
    handoffs = disagg.handoffs
    prompt = _prompt(1, LONG)
    tokens, final = _via_router(cluster, prompt)
    full = (LONG - 1) // BLOCK * BLOCK
    assert final.worker_id == "w-d"
    assert (final.cached_tokens, final.peer_cached_tokens) == (full, full)
    assert disagg.handoffs == handoffs + 1
    assert sum(_load(cluster.workers[k]).prefill_only_requests for k in ("p1", "p2")) >= 1
    fetched = _load(cluster.workers["d"]).peer
    assert fetched.blocks_fetched >= full // BLOCK and fetched.blocks_bad == 0
    assert tokens == _oracle(cluster, prompt, 1)


def test_a_short_prompt_skips_the_hop(cluster: Cluster) -> None:
    disagg = cluster.router.core.disagg
    skips, handoffs = disagg.skips, disagg.handoffs
    prompt = _prompt(2, SHORT)
    tokens, final = _via_router(cluster, prompt)
    assert final.worker_id == "w-d" and final.peer_cached_tokens == 0
    assert (disagg.skips, disagg.handoffs) == (skips + 1, handoffs)
    assert tokens == _oracle(cluster, prompt, 2)


def _mid_hop(cluster: Cluster, victim: Worker, prompt: list[int], hit: signal.Signals,
            then: Callable[[], object] = lambda: None,
            peer_cached_tokens: int = 0) -> tuple[list[int], float]:
    """Send `prompt` through the router with `victim` the first prefill worker it tries, its
    engine held (the stall file) until the request is on it, then signal it and call `then`."""
    victim.stall.touch()
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_via_router, cluster, prompt)
        deadline = time.monotonic() + 60
        while _entry(cluster, victim).in_flight < 1:    # the prefill hop is open on the victim
            assert time.monotonic() < deadline and not future.done(), "the request never reached the prefill worker"
            time.sleep(0.02)
        victim.proc.send_signal(hit)
        then()
        tokens, final = future.result(timeout=300)
    assert final.worker_id == "w-d" and final.peer_cached_tokens == peer_cached_tokens
    return tokens, time.monotonic() - t0


def test_a_prefill_worker_killed_mid_hop_is_retried_on_the_other_one(cluster: Cluster) -> None:
    p1, p2 = cluster.workers["p1"], cluster.workers["p2"]
    p2.stall.touch()                      # p2 stalled too: whichever the router picks is held
    try:
        victim = p1
        prompt = _prompt(3, LONG)
        disagg = cluster.router.core.disagg
        failures, handoffs = disagg.failures, disagg.handoffs
        # p1 is the victim: p2 the second pick, by making it the busier one
        _entry(cluster, p2).in_flight += 100
        try:
            # p1 dies before its first chunk: the hop goes on on p2 (released), which hands the blocks off
            tokens, elapsed = _mid_hop(cluster, victim, prompt, signal.SIGKILL, then=p2.stall.unlink,
                                       peer_cached_tokens=(LONG - 1) // BLOCK * BLOCK)
        finally:
            _entry(cluster, p2).in_flight -= 100
        assert victim.proc.wait(timeout=30) == -signal.SIGKILL
        assert (disagg.failures, disagg.handoffs) == (failures + 1, handoffs + 1)
        assert elapsed < TIMEOUT_S + 60
        assert tokens == _oracle(cluster, prompt, 3)
    finally:
        p2.stall.unlink(missing_ok=True)


def test_a_prefill_worker_stopped_mid_hop_costs_the_request_at_most_the_timeout(cluster: Cluster) -> None:
    # p1 is dead (the test above): p2 is the only prefill worker, no other to retry on
    p2 = cluster.workers["p2"]
    prompt = _prompt(4, LONG)
    failures = cluster.router.core.disagg.failures
    try:
        tokens, elapsed = _mid_hop(cluster, p2, prompt, signal.SIGSTOP)
    finally:
        p2.stall.unlink(missing_ok=True)
        p2.proc.send_signal(signal.SIGCONT)
    assert cluster.router.core.disagg.failures == failures + 1
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 60    # the hop's bound, then the decode worker computes
    assert tokens == _oracle(cluster, prompt, 4)


def test_the_router_metrics_count_hops_skips_and_failures_by_cause(cluster: Cluster) -> None:
    from router.observe.metrics import sample_sum, scrape
    samples = scrape(f"http://127.0.0.1:{cluster.http_port}/metrics")
    assert sample_sum(samples, "kvmesh:router_worker_role", worker_id="w-d", role="decode") == 1
    assert sample_sum(samples, "kvmesh:router_disagg_handoffs_total") >= 1
    assert sample_sum(samples, "kvmesh:router_disagg_prefill_seconds_count") >= 1
    assert sample_sum(samples, "kvmesh:router_disagg_skipped_total", reason="short") >= 1
    assert sample_sum(samples, "kvmesh:router_disagg_failures_total", prefill_worker_id="w-p1",
                      cause="unavailable") == 1
    assert sample_sum(samples, "kvmesh:router_disagg_failures_total", prefill_worker_id="w-p2", cause="timeout") == 1
    assert "kvmesh:router_role_queue_length" in {name for name, _ in samples}


def test_a_decode_worker_killed_mid_stream_migrates_the_stream(cluster: Cluster) -> None:
    """Last in the module: it kills the decode worker. A handed-off request streaming on it
    moves (router/routing/migrate.py) to the live prefill worker (with no decode worker left, a
    prefill worker decodes), which recomputes prompt and streamed tokens: the tokens are the
    same, none is lost or repeated."""
    d = cluster.workers["d"]
    prompt, max_tokens = _prompt(5, LONG), 48
    req = _request(prompt)
    req.sampling.max_tokens = max_tokens
    oracle_req = _request(prompt, "oracle-5")
    oracle_req.sampling.max_tokens = max_tokens
    with grpc.insecure_channel(d.address) as ch:
        want, _ = _tokens(list(pb_grpc.WorkerStub(ch).Generate(oracle_req, timeout=300)))
    handoffs = cluster.router.core.disagg.handoffs
    msgs: list[pb.GenerateResponse] = []
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        for m in pb_grpc.RouterStub(ch).Generate(req, timeout=300):
            msgs.append(m)
            if sum(len(x.token_ids) for x in msgs) >= 4 and d.proc.poll() is None:
                assert m.worker_id == "w-d"
                d.proc.kill()                  # SIGKILL mid-stream
    assert d.proc.wait(timeout=30) == -signal.SIGKILL
    tokens, final = _tokens(msgs)
    assert cluster.router.core.disagg.handoffs == handoffs + 1    # the stream began on a hand-off
    assert final.migrations == 1 and final.worker_id == "w-p2"
    assert tokens == want
