"""The worker server's configuration: where it listens, how it drains, where it registers.

Torch-free and gRPC-free, so the CLI and launchers can build and validate it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from contracts.cluster_token import check_token
from contracts.roles import WorkerRole
from contracts.tls import PLAINTEXT, TlsConfig


@dataclass(frozen=True, slots=True)
class WorkerServerConfig:
    """Where the worker listens and how it drains. `advertise_address` (None → host:port) is
    what peers and the router dial. With `redis_url` the worker registers itself (heartbeat
    with a TTL) and publishes its KV events for the router's block index. With
    `peer_transfer` it fetches hinted prefixes from peers and sends to them over pairs formed
    on demand (worker.peer.plane), hosting its rendezvous store on `host`:`transfer_port` (0 = a
    free port); `transfer_faults` is for tests only (worker.peer.config.PeerConfig).
    Liveness (worker/server/liveness.py): not live once the engine loop has not beaten for
    `liveness_timeout_s` or `max_step_failures` engine steps in a row raised; `stall_file` is
    a test hook only (worker/engine/async_engine.py: the engine thread blocks while it exists).
    `role` (a `WorkerRole` or its spelling): what the router sends it (disaggregated serving);
    it is in the worker's registry record, its GetLoad and its metrics."""

    host: str = "127.0.0.1"
    port: int = 0                        # 0 = a free port, returned by start()
    worker_id: str = "worker-0"
    advertise_address: str | None = None
    drain_timeout_s: float = 30.0
    max_message_bytes: int = 4 * 2**20   # grpc's own default receive limit, made explicit
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    peer_transfer: bool = False
    transfer_port: int = 0
    transfer_timeout_s: float = 10.0
    transfer_faults: tuple[str, ...] = ()
    metrics_port: int | None = None      # Prometheus /metrics (worker/server/metrics.py); None = off, 0 = a free port
    grpc_idle_timeout_s: float = 300.0   # a gRPC connection with no call is closed after this
    liveness_timeout_s: float = 120.0    # the engine loop's heartbeat older than this: not live
    max_step_failures: int = 3           # this many engine steps raising in a row: not live
    stall_file: str | None = None        # tests only: env KVMESH_TEST_STALL_FILE
    # Scaling that keeps the cache (worker/server/scaling.py; needs redis_url and peer_transfer):
    drain_handover: bool = True          # a draining worker hands its hottest blocks to peers with room
    warm_start_mb_s: float = 256.0       # a new worker warms from its peers' hottest at most this (0: off)
    # Cluster authentication (worker/server/cluster_auth.py): the token every Worker RPC then needs, and TLS.
    cluster_token: str | None = field(default=None, repr=False)
    tls: TlsConfig = PLAINTEXT
    role: WorkerRole = WorkerRole.MIXED

    def __post_init__(self) -> None:
        object.__setattr__(self, "transfer_faults", tuple(self.transfer_faults))
        object.__setattr__(self, "role", WorkerRole.parse(self.role))
        if self.cluster_token is not None:
            check_token(self.cluster_token)
        if self.tls.ca is not None and not self.tls.serves_tls:
            raise ValueError("tls_cert: a worker with --tls-ca needs its own --tls-cert/--tls-key (mutual TLS)")
        if not self.host:
            raise ValueError("host is empty")
        if not isinstance(self.transfer_port, int) or not 0 <= self.transfer_port <= 65535:
            raise ValueError(f"transfer_port={self.transfer_port!r} must be in [0, 65535] (0 = a free port)")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s={self.transfer_timeout_s!r} must be > 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 = a free port)")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id={self.worker_id!r} must be non-empty without spaces")
        if self.advertise_address is not None and not _is_host_port(self.advertise_address):
            raise ValueError(f"advertise_address={self.advertise_address!r} must be HOST:PORT")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if not self.grpc_idle_timeout_s > 0:
            raise ValueError(f"grpc_idle_timeout_s={self.grpc_idle_timeout_s!r} must be > 0")
        if not self.warm_start_mb_s >= 0:
            raise ValueError(f"warm_start_mb_s={self.warm_start_mb_s!r} must be >= 0 (0: no warm start)")
        if not self.liveness_timeout_s > 0:
            raise ValueError(f"liveness_timeout_s={self.liveness_timeout_s!r} must be > 0")
        if isinstance(self.max_step_failures, bool) or not isinstance(self.max_step_failures, int) \
                or self.max_step_failures < 1:
            raise ValueError(f"max_step_failures={self.max_step_failures!r} must be an integer >= 1")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be positive")
        if not self.cluster_name:
            raise ValueError("cluster_name is empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port} must be in [0, 65535] (0 = a free port)")


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)
