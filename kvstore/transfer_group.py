"""The transfer group: one two-rank process group per peer pair, on one TCPStore.

The pair groups are `ProcessGroupGloo` / `ProcessGroupNCCL` built directly on one TCPStore
(the rendezvous `init_process_group(init_method="tcp://addr:port")` uses, with a key prefix
per pair) rather than through `init_process_group`: no global default group, and a
process can hold several groups (tests do). NCCL (ops on the device, checksums on a host
copy, receives posted at once since NCCL matches by order, not tag) is untested: this box
has no GPU.

Why a group per pair, and what gloo does on failure: see `kvstore.transfer`.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvstore.errors import KVStoreError

BACKENDS = ("auto", "gloo", "nccl")


class TransferError(KVStoreError):
    """A transfer failed as a whole (peer lost, timeout, protocol mismatch): recompute."""

    def __init__(self, peer: int, transfer_id: int, reason: str) -> None:
        super().__init__(f"transfer {transfer_id} with rank {peer}: {reason}")
        self.peer, self.transfer_id, self.reason = peer, transfer_id, reason

    def __reduce__(self) -> tuple[type[TransferError], tuple[int, int, str]]:
        return (TransferError, (self.peer, self.transfer_id, self.reason))


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Where the transfer group meets and how long a transfer may take."""

    rank: int
    world_size: int
    master_port: int
    master_addr: str = "127.0.0.1"
    backend: str = "auto"  # gloo when the KV device is CPU, nccl for CUDA
    timeout_s: float = 10.0
    rendezvous_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be in [0, world_size={self.world_size})")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port!r} must be in [1, 65535]")
        if not self.master_addr:
            raise ValueError(f"master_addr={self.master_addr!r} must be a host name or address")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; accepted: {', '.join(BACKENDS)}")
        for name in ("timeout_s", "rendezvous_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    def resolve_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"


class TransferGroup:
    """The transfer plane of one worker: one two-rank process group per peer, formed once at
    start. Per-pair groups, because a gloo timeout closes every pair of its group."""

    def __init__(self, config: TransferConfig, device: torch.device, backend: str,
                 store: Any, pairs: dict[int, tuple[Any, int]]) -> None:
        self.config, self.device, self.backend = config, device, backend
        self._store = store  # the store must outlive the groups
        self._pairs = pairs  # peer rank -> (its pair group, the peer's rank in that group)

    @classmethod
    def form(cls, config: TransferConfig, device: str | torch.device = "cpu") -> TransferGroup:
        """Rendezvous with the other `world_size - 1` ranks (blocks until all have joined)."""
        dev = torch.device(device)
        backend = config.resolve_backend(dev)
        if backend == "nccl" and not dist.is_nccl_available():
            raise TransferError(config.rank, -1, "backend=nccl but this torch build has no NCCL")
        wait = timedelta(seconds=config.rendezvous_timeout_s)
        pairs: dict[int, tuple[Any, int]] = {}
        try:
            store = dist.TCPStore(config.master_addr, config.master_port, config.world_size,
                                  config.rank == 0, timeout=wait, wait_for_workers=False)
            for peer in range(config.world_size):  # ascending: every rank forms pairs in one order
                if peer == config.rank:
                    continue
                lo, hi = sorted((config.rank, peer))
                pair_store = dist.PrefixStore(f"kvmesh/transfer/{lo}-{hi}", store)
                local = 0 if config.rank == lo else 1
                pairs[peer] = (_pair_group(backend, pair_store, local, wait), 1 - local)
        except RuntimeError as e:  # DistNetworkError, DistStoreError and gloo errors all are
            raise TransferError(config.rank, -1, f"rendezvous at {config.master_addr}:"
                                f"{config.master_port} failed: {e}") from e
        return cls(config, dev, backend, store, pairs)

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Post a send; the returned work completes once the peer posted the receive."""
        pg, peer_rank = self._pairs[peer]
        return pg.send([tensor], peer_rank, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        pg, peer_rank = self._pairs[peer]
        return pg.recv([tensor], peer_rank, tag)

    def wait(self, work: Any, timeout_s: float) -> None:
        """Block until `work` completes. RuntimeError if the peer is lost or time runs out
        (gloo then closes the pair to that peer for good)."""
        work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        for pg, _ in self._pairs.values():
            pg.shutdown()


def _pair_group(backend: str, store: Any, rank: int, timeout: timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
