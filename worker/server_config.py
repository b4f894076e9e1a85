"""The worker server's configuration: where it listens, how it drains, where it registers.

Torch-free and gRPC-free, so the CLI and launchers can build and validate it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerServerConfig:
    """Where the worker listens and how it drains. `advertise_address` (None → host:port) is
    what peers and the router dial. With `redis_url` the worker registers itself (heartbeat
    with a TTL) and publishes its KV events for the router's block index. With
    `world_size > 1` it joins the peer-transfer group at `dist_init_addr` (HOST:PORT, where
    rank 0 listens) as `rank`; `transfer_faults` is for tests only (worker.peer.PeerConfig)."""

    host: str = "127.0.0.1"
    port: int = 0                        # 0 = a free port, returned by start()
    worker_id: str = "worker-0"
    advertise_address: str | None = None
    drain_timeout_s: float = 30.0
    max_message_bytes: int = 4 * 2**20   # grpc's own default receive limit, made explicit
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    rank: int = 0
    world_size: int = 1
    dist_init_addr: str | None = None
    transfer_timeout_s: float = 10.0
    transfer_faults: tuple[str, ...] = ()
    metrics_port: int | None = None      # Prometheus /metrics (worker/metrics.py); None = off, 0 = a free port
    grpc_idle_timeout_s: float = 300.0   # a gRPC connection with no call is closed after this

    def __post_init__(self) -> None:
        object.__setattr__(self, "transfer_faults", tuple(self.transfer_faults))
        if not self.host:
            raise ValueError("host is empty")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be in [0, world_size={self.world_size})")
        if self.world_size > 1 and (self.dist_init_addr is None or not _is_host_port(self.dist_init_addr)):
            raise ValueError(f"dist_init_addr={self.dist_init_addr!r} must be HOST:PORT when world_size > 1")
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
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be positive")
        if not self.cluster_name:
            raise ValueError("cluster_name is empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port} must be in [0, 65535] (0 = a free port)")

    @property
    def peer_transfer(self) -> bool:
        return self.world_size > 1


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)
