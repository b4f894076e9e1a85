"""Multi-host Ray for real: three "hosts" made of network namespaces on this machine
(tests/support/podnet_ray.py: a head with 0 CPUs and two nodes with 2 CPUs each, each with its
own IP, joined with `ray start --address`).

Default run: the three hosts form one Ray cluster and a SPREAD placement group of two bundles
lands on two different hosts (what `kvmesh serve --ray --placement-strategy SPREAD` asks for).
Slow: `kvmesh serve --ray --ray-address HEAD:PORT --placement-strategy SPREAD --workers 2` run
on the head (driver, Redis, router bound to the head's IP): the two worker actors serve from
the two nodes' IPs; a prefix computed on one host's worker is fetched by the other host's
worker over the peer plane (gloo over the bridge) and gives the same greedy tokens; then one
host's namespace is torn down (every process SIGKILLed, the namespace deleted) while requests
stream through the router: none fails or hangs (the router migrates the streams), the lost
actor is replaced on the surviving host, and the router routes to the replacement.

Needs root (network namespaces); skipped, saying why, where that is missing. Never `ray stop`.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from contracts.cluster_token import TOKEN_ENV, TOKEN_METADATA, new_token
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.podnet_client import prompt, request
from tests.support.podnet_ns import skip_reason
from tests.support.podnet_ray import RayHosts

pytestmark = [pytest.mark.multiproc]

_SKIP = skip_reason()
_READY = re.compile(r"^kvmesh serve --ray: ready", re.M)
_LINE = re.compile(r"^  (gRPC|HTTP|workers)\s+(.+)$", re.M)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[RayHosts]:
    if _SKIP is not None:
        pytest.skip(_SKIP)
    h = RayHosts(tmp_path)
    try:
        yield h
    finally:
        h.close()


def _on_head(hosts: RayHosts, code: str, timeout_s: float = 300) -> str:
    """A Python driver run on the head host; its output (it must exit 0)."""
    proc = hosts.run("head", [sys.executable, "-c", code], "driver")
    rc = proc.wait(timeout_s)
    out = hosts.log("driver", 200)
    assert rc == 0, out
    return out


def test_three_netns_hosts_form_one_ray_cluster_and_spread_puts_bundles_on_two_hosts(hosts: RayHosts) -> None:
    code = (f"import json, time, ray\nray.init(address={hosts.address!r}, log_to_driver=False)\n"
            "t = time.time()\n"
            "while len([n for n in ray.nodes() if n['Alive']]) < 3 and time.time() - t < 120:\n"
            "    time.sleep(0.5)\n"
            "nodes = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}\n"
            "pg = ray.util.placement_group([{'CPU': 1}, {'CPU': 1}], strategy='SPREAD')\n"
            "ray.get(pg.ready(), timeout=120)\n"
            "placed = ray.util.placement_group_table(pg)['bundles_to_node_id']\n"
            "print('RESULT', json.dumps({'nodes': sorted(nodes.values()), "
            "'bundles': sorted(nodes[n] for n in placed.values())}))\n")
    out = _on_head(hosts, code)
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    ips = hosts.ips
    assert result["nodes"] == sorted(ips.values())
    assert result["bundles"] == sorted([ips["host-1"], ips["host-2"]])   # the head has no CPU to offer


class _Load(threading.Thread):
    """Streams through the router back to back until stopped; counts what ended how."""

    def __init__(self, target: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.target, self.stop = target, stop
        self.finished: list[str] = []       # worker id of each finished request
        self.failed: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.target) as ch:
            stub = pb_grpc.RouterStub(ch)
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    msgs = list(stub.Generate(request(prompt(1000 + n, 40), max_tokens=24), timeout=240))
                    assert msgs[-1].finished
                    self.finished.append(msgs[-1].worker_id)
                except grpc.RpcError as e:
                    self.failed.append(f"{e.code()}: {e.details()}")


def _router_workers(http: str) -> dict[str, str]:
    """worker id -> address of the workers up in the router's routing (GET /v1/cluster)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{http}/v1/cluster", timeout=10) as r:
        doc = json.loads(r.read().decode())
    return {w["worker_id"]: w.get("address", "") for w in doc["workers"] if w.get("up")}


@pytest.mark.slow
def test_serve_ray_spreads_workers_over_hosts_moves_a_prefix_and_survives_losing_a_host(hosts: RayHosts) -> None:
    token = new_token()
    head = hosts.ips["head"]
    driver = hosts.run("head", [sys.executable, "-m", "kvmesh.cli", "serve", "--ray", "--ray-address", hosts.address,
                                "--placement-strategy", "SPREAD", "--workers", "2", "--cpus-per-worker", "1",
                                "--host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0",
                                "--cluster-name", "hosts", "--num-blocks", "128", "--startup-timeout-s", "600"],
                       "serve", env={TOKEN_ENV: token})
    deadline = time.monotonic() + 900
    while not _READY.search(hosts.log("serve", 400)):
        assert driver.poll() is None, hosts.log("serve")
        assert time.monotonic() < deadline, hosts.log("serve")
        time.sleep(2)
    lines = dict(_LINE.findall(hosts.log("serve", 400)))
    target = f"{head}:{lines['gRPC'].rsplit(':', 1)[1]}"
    http = f"http://{head}:{lines['HTTP'].rsplit(':', 1)[1].split('/', 1)[0]}"
    addresses = lines["workers"].split()
    worker_ips = sorted(a.rsplit(":", 1)[0] for a in addresses)
    assert worker_ips == sorted([hosts.ips["host-1"], hosts.ips["host-2"]]), addresses   # SPREAD: one per host

    # a prefix computed on worker-0's host, fetched by worker-1 on the other host
    ids = prompt(7)
    meta = ((TOKEN_METADATA, token),)
    with grpc.insecure_channel(addresses[0]) as ch:
        first = list(pb_grpc.WorkerStub(ch).Generate(request(ids), timeout=240, metadata=meta))
    hinted = request(ids)
    hinted.peer_hints.append(pb.PeerHint(worker_id="worker-0", address=addresses[0], num_blocks=len(ids) // 16))
    with grpc.insecure_channel(addresses[1]) as ch:
        second = list(pb_grpc.WorkerStub(ch).Generate(hinted, timeout=240, metadata=meta))
    assert second[-1].peer_cached_tokens >= 16 * ((len(ids) - 1) // 16), second[-1]
    assert [t for m in second for t in m.token_ids] == [t for m in first for t in m.token_ids]

    # one host torn down under load
    stop = threading.Event()
    load = [_Load(target, stop) for _ in range(3)]
    for t in load:
        t.start()
    time.sleep(10)
    lost_host = next(h for h in ("host-1", "host-2") if hosts.ips[h] == addresses[1].rsplit(":", 1)[0])
    survivor_ip = hosts.ips["host-1" if lost_host == "host-2" else "host-2"]
    hosts.tear_down(lost_host)
    torn = time.monotonic()
    deadline = torn + 600
    while True:     # the replacement of worker-1 serves from the surviving host, in the router's routing
        up = _router_workers(http)
        if up.get("worker-1", "").startswith(survivor_ip + ":") and "worker-0" in up:
            break
        assert driver.poll() is None, hosts.log("serve")
        assert time.monotonic() < deadline, (up, hosts.log("serve"))
        time.sleep(2)
    replaced_s = time.monotonic() - torn
    time.sleep(5)
    stop.set()
    for t in load:
        t.join(300)
        assert not t.is_alive(), "a request hangs"
    print(f"worker-1 replaced on {survivor_ip} {replaced_s:.0f} s after its host was torn down; "
          f"{sum(len(t.finished) for t in load)} requests finished under load")
    assert [f for t in load for f in t.failed] == []
    assert sum(len(t.finished) for t in load) >= 3
    assert "restarted worker-1" in hosts.log("serve", 400)
