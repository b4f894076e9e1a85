"""Pairs formed on demand: one two-member process group per (receiver, sender) pair.

There is no world: a worker is a `PeerId` (worker id + a generation drawn at each start, so
a restarted worker is a new peer), and every pair of workers that exchanges blocks builds its
own two-member group when it first needs one, through a store the receiver hosts
(`RendezvousStore`, a `torch.distributed.TCPStore` server on the receiver; the sender reaches
it with `connect_store`). The group is a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU;
written, never run here: this box has no GPU) built directly on a `PrefixStore(key, store)`,
outside torch's global default group, so a process holds any number of them and none depends
on any other. The key names the pair and one formation of it (the receiver draws a fresh
random key each time), so a pair torn down and formed again never meets its old rendezvous.

Why per pair: a gloo timeout closes every pair of its process group for good, on both sides,
and a dead member fails every op with it; with two members per group that loses exactly one
pair, which the next fetch forms again (see `kvstore.transfer.blocks` and `worker.peer.plane`).
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
    """A transfer (or forming a pair) failed as a whole: peer lost, timeout, protocol
    mismatch. The caller recomputes; the pair is torn down."""

    def __init__(self, peer: str, transfer_id: int, reason: str) -> None:
        super().__init__(f"transfer {transfer_id} with {peer}: {reason}")
        self.peer, self.transfer_id, self.reason = peer, transfer_id, reason

    def __reduce__(self) -> tuple[type[TransferError], tuple[str, int, str]]:
        return (TransferError, (self.peer, self.transfer_id, self.reason))


@dataclass(frozen=True, slots=True)
class PeerId:
    """One start of one worker: a restarted worker keeps its id and gets a new generation."""

    worker_id: str
    generation: int

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id={self.worker_id!r} must be non-empty without spaces")
        if not isinstance(self.generation, int) or self.generation < 0:
            raise ValueError(f"generation={self.generation!r} must be a non-negative integer")

    def __str__(self) -> str:
        return f"{self.worker_id}#{self.generation}"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How pairs form and how long a transfer may take."""

    backend: str = "auto"            # gloo when the KV device is CPU, nccl for CUDA
    timeout_s: float = 10.0          # one transfer, from its request to its last byte
    connect_timeout_s: float = 10.0  # forming one pair (store connect + gloo rendezvous)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; accepted: {', '.join(BACKENDS)}")
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    def resolve_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"


class RendezvousStore:
    """The TCPStore server a receiver hosts for the pairs it forms (one per worker)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        try:
            self.store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                                       wait_for_workers=False)
        except RuntimeError as e:
            raise TransferError("-", -1, f"cannot host the rendezvous store on {host}:{port}: {e}") from e
        self.host = host

    @property
    def port(self) -> int:
        return int(self.store.port)

    def address(self, advertise_host: str | None = None) -> str:
        return f"{advertise_host or self.host}:{self.port}"


def connect_store(address: str, timeout_s: float) -> Any:
    """A client of the rendezvous store at HOST:PORT; TransferError when it cannot connect."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(address, -1, f"store address {address!r} is not HOST:PORT")
    try:
        return dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
    except RuntimeError as e:   # DistNetworkError / DistStoreError
        raise TransferError(address, -1, f"cannot reach the rendezvous store {address}: {e}") from e


class PairGroup:
    """One two-member process group: this process is `local_rank` (0: the receiver, who hosts
    the store; 1: the sender), `peer` the other. `broken` is set (by `BlockTransfer`) once an
    op on it failed: gloo has then closed the pair, and a new key must be formed."""

    def __init__(self, key: str, peer: PeerId, local_rank: int, device: torch.device, backend: str,
                 pg: Any, store: Any) -> None:
        self.key, self.peer, self.local_rank = key, peer, local_rank
        self.device, self.backend = device, backend
        self._pg, self._store = pg, store      # the store must outlive the group
        self._held: dict[int, tuple[torch.Tensor, ...]] = {}
        self.broken: str | None = None

    @classmethod
    def form(cls, key: str, store: Any, local_rank: int, peer: PeerId, device: str | torch.device,
             cfg: TransferConfig) -> PairGroup:
        """Rendezvous with the peer under `key` (blocks until it joins or the connect timeout)."""
        dev = torch.device(device)
        backend = cfg.resolve_backend(dev)
        if backend == "nccl" and not dist.is_nccl_available():
            raise TransferError(str(peer), -1, "backend=nccl but this torch build has no NCCL")
        timeout = timedelta(seconds=cfg.connect_timeout_s)
        prefixed = dist.PrefixStore(f"kvmesh/pair/{key}", store)
        pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        try:
            if backend == "gloo":
                pg = dist.ProcessGroupGloo(prefixed, local_rank, 2, timeout)
                pg._set_default_timeout(timedelta(seconds=cfg.timeout_s))
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=cfg.timeout_s)
                pg = dist.ProcessGroupNCCL(prefixed, local_rank, 2, options)
        except RuntimeError as e:   # DistStoreError (peer never came), gloo connect errors
            raise TransferError(str(peer), -1, f"forming pair {key} failed: {e}") from e
        return cls(key, peer, local_rank, dev, backend, pg, store)

    @property
    def peer_rank(self) -> int:
        return 1 - self.local_rank

    def isend(self, tensor: torch.Tensor, tag: int) -> Any:
        """Post a send; the returned work completes once the peer posted the receive."""
        return self._live().send([tensor], self.peer_rank, tag)

    def irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        return self._live().recv([tensor], self.peer_rank, tag)

    def _live(self) -> Any:
        if self._pg is None:
            raise RuntimeError(f"pair {self.key} is closed")
        return self._pg

    def wait(self, work: Any, timeout_s: float) -> None:
        """Block until `work` completes. RuntimeError if the peer is lost or time runs out
        (gloo then closes this pair for good)."""
        work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def hold(self, bufs: tuple[torch.Tensor, ...]) -> None:
        """Keep `bufs` alive until `release(bufs)` or `close()`: receives posted into them
        cannot be cancelled, so a transfer that fails early must not free their memory."""
        self._held[id(bufs)] = bufs

    def release(self, bufs: tuple[torch.Tensor, ...]) -> None:
        """Every op posted into `bufs` has completed."""
        self._held.pop(id(bufs), None)

    def close(self) -> None:
        """Shut the group down (idempotent); pending ops on it fail."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
        self._held.clear()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
