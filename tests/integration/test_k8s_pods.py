"""The worker lifecycle on the rendered chart run as processes (tests/support/podnet.py: one network namespace per
pod, each process started with exactly the command line and env the manifests give it):

- scaling 2 -> 3 -> 2 workers with traffic flowing through the router: no request fails, the
  new worker receives requests, the removed one (SIGTERM, as the kubelet stops a pod) leaves
  routing;
- an engine stuck on purpose (KVMESH_TEST_STALL_FILE, per pod through `$(POD_NAME)` in the
  chart's worker.extraEnv) turns the worker's liveness not-live (gRPC `kvmesh.v1.Liveness`,
  HTTP /livez, and the chart's own livenessProbe) while readiness takes it out of routing; the
  kubelet's answer, a restart, brings it back.
The restart case (kill -9, start again under the same pod name, then a peer fetch both
ways) is `test_peer_transfer_to_and_from_a_restarted_worker` in test_podnet_partitions.py.
"""
from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.health import LIVENESS_SERVICE
from kvmesh.bench.chaos_harness import wait_until
from tests.support.podnet import PodCluster, skip_reason
from tests.support.podnet_client import on_worker, prompt, running, via_router, workers_up

pytestmark = pytest.mark.multiproc

# Every worker of the StatefulSet gets it: small enough for a quick test, large enough that a
# healthy engine starved of CPU on a loaded 2-core machine is not taken for stuck (3 s is too short).
LIVENESS_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"pod network unavailable: {reason}")
    tmp = tmp_path_factory.mktemp("k8s")
    worker: dict[str, object] = {"replicas": 2, "liveness": {"timeoutS": LIVENESS_TIMEOUT_S},
                                 "extraEnv": [{"name": "KVMESH_TEST_STALL_FILE", "value": f"{tmp}/stall-$(POD_NAME)"}]}
    cluster = PodCluster(tmp, {"worker": worker})
    with running(cluster) as c:
        yield c


class Traffic:
    """Greedy requests through the router, one after another (`pause_s` apart) on each of
    `streams` threads, until `stop()`; records which worker served each and every failure."""

    def __init__(self, cl: PodCluster, streams: int = 1, pause_s: float = 0.1) -> None:
        self.pause_s = pause_s
        self.cl = cl
        self.served: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._seeds = itertools.count(1000)
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.served.append(via_router(self.cl, prompt(next(self._seeds), 40), max_tokens=4).final.worker_id)
            except (grpc.RpcError, AssertionError) as e:
                self.failures.append(repr(e)[:300])
            self._stop.wait(self.pause_s)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def test_scale_2_3_2_with_traffic_flowing(cl: PodCluster) -> None:
    new = cl.worker(2)
    traffic = Traffic(cl)
    try:
        assert wait_until(lambda: len(traffic.served) >= 4, 60) is not None
        cl.start_worker(2)                                        # kubectl scale --replicas=3
        assert wait_until(lambda: workers_up(cl).get(new), 60) is not None, cl.logs(cl.router)[-3000:]
        assert wait_until(lambda: new in traffic.served, 60) is not None, traffic.served[-20:]
        grace = int(cl.pods[new].run.spec.get("terminationGracePeriodSeconds", 30) or 30)
        code = cl.kill(new, signal.SIGTERM, wait_s=grace)             # kubectl scale --replicas=2
        assert code == 0, cl.logs(new)[-3000:]
        assert wait_until(lambda: not workers_up(cl).get(new), 30) is not None
        mark = len(traffic.served)
        assert wait_until(lambda: len(traffic.served) >= mark + 6, 60) is not None
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert new not in traffic.served[mark:], traffic.served[mark:]
    print(f"{len(traffic.served)} requests, 0 failed; {traffic.served.count(new)} served by {new}")


def test_stuck_engine_is_not_live_and_leaves_routing(cl: PodCluster) -> None:
    stuck, healthy = cl.worker(1), cl.worker(0)
    assert cl.probe(stuck, "livenessProbe") and _live(cl, stuck) and _livez(cl, stuck)
    stall = Path(cl.pods[stuck].run.env["KVMESH_TEST_STALL_FILE"])
    assert stall.name == f"stall-{stuck}"                        # $(POD_NAME) expanded per pod
    stall.touch()
    try:
        # a request already on the stuck engine makes no progress; liveness sees it
        hung = threading.Thread(target=lambda: _quietly(lambda: on_worker(cl, stuck, prompt(7), timeout_s=60)),
                                daemon=True)
        hung.start()
        assert wait_until(lambda: not _live(cl, stuck), 4 * LIVENESS_TIMEOUT_S + 10) is not None
        assert not _livez(cl, stuck)
        assert not cl.probe(stuck, "livenessProbe")               # the chart's probe would restart it
        assert wait_until(lambda: not workers_up(cl).get(stuck), 30) is not None   # out of routing
        for seed in range(4):
            assert via_router(cl, prompt(300 + seed, 40), max_tokens=4).final.worker_id == healthy
    finally:
        stall.unlink(missing_ok=True)
    cl.restart(stuck)                                             # what the kubelet does next
    assert _live(cl, stuck) and cl.probe(stuck, "livenessProbe")
    assert wait_until(lambda: workers_up(cl).get(stuck), 60) is not None


def _live(cl: PodCluster, pod: str) -> bool:
    try:
        with grpc.insecure_channel(cl.addr(pod, "grpc")) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE),
                                                         timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _livez(cl: PodCluster, pod: str) -> bool:
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(cl.url(pod, "metrics", "/livez"), timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _quietly(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except (grpc.RpcError, AssertionError):
        pass
