"""Real Redis topologies for tests, on loopback: a Redis Cluster (3 primaries, each optionally with
a replica) and a Sentinel-managed primary (a primary, a replica and 3 sentinels).

Both are made of `tests.support.redis_server.RedisServer` children. The cluster is formed by hand
(CLUSTER ADDSLOTSRANGE, MEET, REPLICATE) instead of `redis-cli --cluster create`, which sleeps a
second per step: a 3-primary cluster is up in well under a second. Their fixtures
(`redis_cluster`, `redis_sentinel`) are registered for every test by tests/conftest.py; each test
gets a fresh topology, stopped after it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import REDIS_SERVER, RedisServer, free_port

PASSWORD = "topology-pw"
NUM_SLOTS = 16384


def _wait(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except redis.RedisError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{what}: not within {timeout_s} s")


def _cluster_info(r: redis.Redis) -> dict[str, str]:
    text = str(r.execute_command("CLUSTER", "INFO"))
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


class RedisClusterNodes:
    """`num_primaries` primaries sharing the 16384 slots evenly, and `replicas` of them (the first
    `replicas` primaries) each followed by one replica. Every node requires `PASSWORD`.
    `url` names the first primary: any node's URL serves a cluster client."""

    def __init__(self, workdir: Path, num_primaries: int = 3, replicas: int = 0,
                 node_timeout_ms: int = 1000) -> None:
        assert 0 <= replicas <= num_primaries
        args = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--requirepass", PASSWORD, "--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0"]
        self.nodes: list[RedisServer] = []
        self.bus_ports: list[int] = []   # the default, port + 10000, may be past 65535
        for i in range(num_primaries + replicas):
            d = workdir / f"node-{i}"
            d.mkdir()
            self.bus_ports.append(free_port())
            self.nodes.append(RedisServer(d, [*args, "--cluster-port", str(self.bus_ports[-1]),
                                              "--cluster-config-file", str(d / "nodes.conf")]))
        self.num_primaries = num_primaries

    @property
    def primaries(self) -> list[RedisServer]:
        return self.nodes[:self.num_primaries]

    @property
    def replicas(self) -> list[RedisServer]:
        return self.nodes[self.num_primaries:]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def admin(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=PASSWORD, decode_responses=True)

    def start(self, timeout_s: float = 20.0) -> None:
        for node in self.nodes:
            node.start()
        per = NUM_SLOTS // self.num_primaries
        for i, node in enumerate(self.primaries):
            hi = NUM_SLOTS - 1 if i == self.num_primaries - 1 else (i + 1) * per - 1
            with self.admin(node) as r:
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
        with self.admin(self.nodes[0]) as first:
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        _wait("every node sees every other", lambda: all(self._known(n) == len(self.nodes) for n in self.nodes),
              timeout_s)
        for primary, replica in zip(self.primaries, self.replicas):
            with self.admin(primary) as p, self.admin(replica) as r:
                r.execute_command("CLUSTER", "REPLICATE", p.execute_command("CLUSTER", "MYID"))
        _wait("the cluster state is ok on every node", self.healthy, timeout_s)

    def _known(self, node: RedisServer) -> int:
        with self.admin(node) as r:
            return int(_cluster_info(r).get("cluster_known_nodes", 0))

    def healthy(self) -> bool:
        """Every running node says cluster_state:ok, all slots served, and every replica is in sync."""
        for node in self.nodes:
            if not node.running:
                continue
            with self.admin(node) as r:
                info = _cluster_info(r)
                if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != NUM_SLOTS:
                    return False
                rep = r.info("replication")
                if rep.get("role") == "slave" and rep.get("master_link_status") != "up":
                    return False
        return True

    def kill_primary(self, index: int = 0, timeout_s: float = 20.0) -> RedisServer:
        """SIGKILL primary `index` (it must have a replica) and wait until its replica serves its
        slots. Returns the killed node (its data is gone; `start` brings it back empty)."""
        victim, replica = self.primaries[index], self.replicas[index]
        victim.stop()

        def promoted() -> bool:
            with self.admin(replica) as r:
                return r.info("replication").get("role") == "master" and self.healthy()

        _wait("the replica is promoted", promoted, timeout_s)
        return victim

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class RedisSentinelGroup:
    """A primary, one replica and `num_sentinels` sentinels watching it as `MASTER` (quorum 2).
    The data nodes require `PASSWORD`; the sentinels do not. `url` is the kvmesh Sentinel URL."""

    MASTER = "kvmesh-primary"

    def __init__(self, workdir: Path, num_sentinels: int = 3, down_after_ms: int = 500,
                 failover_timeout_ms: int = 5000) -> None:
        auth = ["--requirepass", PASSWORD, "--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0"]
        (workdir / "primary").mkdir()
        (workdir / "replica").mkdir()
        self.primary = RedisServer(workdir / "primary", auth)
        self.replica = RedisServer(workdir / "replica", [*auth, "--replicaof", "127.0.0.1", "0"])
        self.sentinels: list[RedisServer] = []
        self._workdir = workdir
        self._num_sentinels = num_sentinels
        self._down_after_ms, self._failover_timeout_ms = down_after_ms, failover_timeout_ms

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{self.MASTER}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        self.primary.start()
        self.replica.extra_args[-1] = str(self.primary.port)
        self.replica.start()
        for i in range(self._num_sentinels):
            d = self._workdir / f"sentinel-{i}"
            d.mkdir()
            conf = d / "sentinel.conf"
            conf.write_text(
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel auth-pass {self.MASTER} {PASSWORD}\n"
                f"sentinel down-after-milliseconds {self.MASTER} {self._down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER} {self._failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n")
            sentinel = _SentinelServer(d, conf)
            sentinel.start()
            self.sentinels.append(sentinel)
        _wait("the replica is in sync", self._replica_in_sync, timeout_s)
        _wait("every sentinel knows the replica and the others",
              lambda: all(self._sentinel_view(s) == (1, self._num_sentinels - 1) for s in self.sentinels),
              timeout_s)

    def _replica_in_sync(self) -> bool:
        with redis.Redis(port=self.replica.port, password=PASSWORD, decode_responses=True) as r:
            return r.info("replication").get("master_link_status") == "up"

    def _sentinel_view(self, sentinel: RedisServer) -> tuple[int, int]:
        with redis.Redis(port=sentinel.port, decode_responses=True) as s:
            state = s.execute_command("SENTINEL", "MASTER", self.MASTER)
            fields = dict(zip(state[0::2], state[1::2])) if isinstance(state, list) else state
            return int(fields["num-slaves"]), int(fields["num-other-sentinels"])

    def master_port(self) -> int:
        with redis.Redis(port=self.sentinels[0].port, decode_responses=True) as s:
            return int(s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)[1])

    def kill_primary(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the primary and wait until the sentinels name the replica as the primary and it
        accepts writes. The killed node stays down."""
        self.primary.stop()

        def promoted() -> bool:
            if self.master_port() != self.replica.port:
                return False
            with redis.Redis(port=self.replica.port, password=PASSWORD, decode_responses=True) as r:
                return r.info("replication").get("role") == "master"

        _wait("a sentinel failover to the replica", promoted, timeout_s)

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.primary]:
            node.stop()


class _SentinelServer(RedisServer):
    """`redis-server CONF --sentinel` on a free port (the sentinel rewrites CONF as it learns)."""

    def __init__(self, workdir: Path, conf: Path) -> None:
        super().__init__(workdir)
        self._conf = conf

    def start(self, timeout_s: float = 10.0) -> None:
        import subprocess
        assert not self.running
        cmd = [REDIS_SERVER, str(self._conf), "--sentinel", "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.workdir), "--logfile", str(self.workdir / "sentinel.log"), "--daemonize", "no"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.num_starts += 1
        _wait(f"sentinel on port {self.port}", lambda: self._pings(), timeout_s)

    def _pings(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise RuntimeError(f"redis-server --sentinel exited with {self._proc.returncode}")
        with redis.Redis(port=self.port, socket_timeout=0.5) as s:
            return bool(s.ping())


def _require_binary() -> None:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")


@pytest.fixture
def redis_cluster_factory(tmp_path: Path) -> Iterator[Callable[..., RedisClusterNodes]]:
    """`make(num_primaries=3, replicas=0) -> RedisClusterNodes`, started; stopped after the test."""
    _require_binary()
    made: list[RedisClusterNodes] = []

    def make(num_primaries: int = 3, replicas: int = 0) -> RedisClusterNodes:
        d = tmp_path / f"cluster-{len(made)}"
        d.mkdir()
        cluster = RedisClusterNodes(d, num_primaries, replicas)
        made.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_factory: Callable[..., RedisClusterNodes]) -> RedisClusterNodes:
    """A 3-primary Redis Cluster without replicas."""
    return redis_cluster_factory()


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[RedisSentinelGroup]:
    """A primary + replica + 3 sentinels."""
    _require_binary()
    d = tmp_path / "sentinel-group"
    d.mkdir()
    group = RedisSentinelGroup(d)
    try:
        group.start()
        yield group
    finally:
        group.stop()
