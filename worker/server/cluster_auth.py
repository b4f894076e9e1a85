"""The worker's side of cluster authentication: who may call its
`kvmesh.v1.Worker` RPCs, and how it proves itself to the router.

- With a cluster token (`WorkerServerConfig.cluster_token`) every Worker RPC — Generate (with or
  without peer hints or priority), Abort, GetLoad, GetModelInfo, GetTokenizer, SendBlocks,
  ResetPrefixCache — needs the token
  as metadata (`server_interceptors`); only `Attest`, health and reflection are open. The
  router is the only client that holds the token, so peer hints (which name the peers a worker
  dials and sends the token to) come only from the router, which builds them from the workers
  it admitted: the hints name registered, attested workers only.
- `Attest` answers the router's nonce with `attestation_mac` over this worker's id and the
  address it advertises: the router admits a worker it found in Redis only after that check.
- With TLS (`WorkerServerConfig.tls`) the port serves mutual TLS: a client without a
  certificate from `--tls-ca` fails the handshake; peers dial each other with their own.
Without a token or TLS the worker serves plain gRPC, open to anyone who reaches it (loopback
development).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from contracts.cluster_token import NONCE_BYTES, attestation_mac
from contracts.grpc_auth import ClusterTokenGuard, token_interceptors
from contracts.wire import to_send_blocks_request
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from worker.peer.errors import PeerUnavailable
from worker.server.config import WorkerServerConfig

if TYPE_CHECKING:
    from worker.peer.config import AskAnswer

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
OPEN_METHODS = ("Attest",)


def server_interceptors(cfg: WorkerServerConfig) -> list[grpc.aio.ServerInterceptor]:
    if cfg.cluster_token is None:
        return []
    return [ClusterTokenGuard(cfg.cluster_token, WORKER_SERVICE, OPEN_METHODS)]


def bind(server: grpc.aio.Server, cfg: WorkerServerConfig) -> int:
    """Bind the worker's port: mutual TLS when --tls-ca is set with a certificate, TLS when only
    a certificate is set, else plaintext."""
    return cfg.tls.add_port(server, f"{cfg.host}:{cfg.port}", require_client_cert=cfg.tls.ca is not None)


def peer_channel(cfg: WorkerServerConfig, address: str) -> grpc.aio.Channel:
    """A channel to a peer worker: this worker's certificate and the token ride along."""
    token = cfg.cluster_token
    return cfg.tls.aio_channel(address, options=[("grpc.max_send_message_length", cfg.max_message_bytes)],
                               interceptors=token_interceptors(lambda: token))


async def attest(cfg: WorkerServerConfig, address: str, request: pb.AttestRequest,
                 context: grpc.aio.ServicerContext) -> pb.AttestResponse:
    """The handshake's answer; FAILED_PRECONDITION when this worker holds no token."""
    if cfg.cluster_token is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no cluster token")
    if len(request.nonce) != NONCE_BYTES:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"nonce: must be {NONCE_BYTES} bytes")
    assert cfg.cluster_token is not None
    return pb.AttestResponse(worker_id=cfg.worker_id, address=address,
                             mac=attestation_mac(cfg.cluster_token, request.nonce, cfg.worker_id, address))


def describe(cfg: WorkerServerConfig) -> Sequence[str]:
    """What is on, for the startup log line (never a secret)."""
    return (("mutual TLS" if cfg.tls.ca is not None else "TLS") if cfg.tls.serves_tls else "plaintext",
            "cluster token" if cfg.cluster_token is not None else "no cluster token")


class PeerCalls:
    """The control-plane call of a fetch (`worker.peer.config.AskPeer`): `SendBlocks` to the peer
    holding the blocks, over one authenticated channel per peer address."""

    def __init__(self, cfg: WorkerServerConfig) -> None:
        self.cfg = cfg
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def ask(self, address: str, block_hashes: Sequence[int], transfer_id: int,
                  pair: dict[str, Any]) -> AskAnswer:
        from worker.peer.config import AskAnswer  # torch: with the peer plane
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = peer_channel(self.cfg, address)
        request = to_send_blocks_request(block_hashes, transfer_id, **pair)
        try:
            response = await pb_grpc.WorkerStub(channel).SendBlocks(request, timeout=self.cfg.transfer_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PeerUnavailable(f"{e.code().name}: {e.details()}") from None
        return AskAnswer(int(response.num_blocks), int(response.generation), bool(response.pair_unknown))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
