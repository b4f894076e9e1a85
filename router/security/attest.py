"""The router's admission of workers: a worker found in Redis (or named by
--worker) serves only after it proves it belongs to the cluster.

Proofs, whichever are configured (RouterConfig):
- mutual TLS (`tls.ca`): the channel verifies the worker's certificate against the CA (and the
  worker verifies the router's); a server without such a certificate never completes a call;
- the cluster token: `Worker/Attest` with a fresh 32-byte nonce must return
  `attestation_mac(token, nonce, worker_id, address)` where `address` is the very HOST:PORT the
  router dialled — a fake worker has no token, and relaying the nonce to a real worker yields
  a MAC over the real worker's address, not the fake one's. Only once admitted do calls to the
  worker carry the token (`x-kvmesh-cluster-token`), so a fake worker never sees it.
A worker that fails is logged as REJECTED and never served. Without a token and without
`--tls-ca` every worker is admitted unchecked (loopback dev); the router warns once.
"""
from __future__ import annotations

import enum
import logging
import secrets
from collections.abc import Callable
from typing import NamedTuple

import grpc

from contracts.cluster_token import NONCE_BYTES, verify_attestation
from contracts.grpc_auth import token_interceptors
from contracts.tokenizer import MAX_TOKENIZER_MESSAGE_BYTES
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig

log = logging.getLogger("kvmesh.router")
# What one worker reply may hold: GetTokenizer's files are the largest.
MAX_WORKER_REPLY_BYTES = MAX_TOKENIZER_MESSAGE_BYTES


class Verdict(enum.Enum):
    ADMITTED = "admitted"
    REJECTED = "rejected"     # for good: logged once, never served


class Admission(NamedTuple):
    verdict: Verdict
    reason: str = ""


def worker_channel(cfg: RouterConfig, address: str, admitted: Callable[[], bool]) -> grpc.aio.Channel:
    """The router's channel to one worker: TLS per `cfg.tls` (the router's certificate is its
    client certificate), the cluster token on each call once `admitted()` says so."""
    token = cfg.cluster_token
    return cfg.tls.aio_channel(address, options=(("grpc.max_receive_message_length", MAX_WORKER_REPLY_BYTES),),
                               interceptors=token_interceptors(
        lambda: token if token is not None and admitted() else None))


class Admitter:
    """Runs the handshake for the registry (router/workers/registry.py)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._warned = False

    @property
    def checks(self) -> bool:
        return self.cfg.cluster_token is not None or self.cfg.tls.ca is not None

    async def admit(self, address: str, stub: pb_grpc.WorkerStub, timeout: float) -> Admission:
        """The verdict on the worker dialled at `address`. Raises grpc.aio.AioRpcError when the
        worker cannot be reached (UNAVAILABLE, deadline): not a verdict, probe again later."""
        token = self.cfg.cluster_token
        if token is None:
            self._warn_open()
            return Admission(Verdict.ADMITTED)     # mTLS (if any) was checked by the channel itself
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            reply = await stub.Attest(pb.AttestRequest(nonce=nonce), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            return self._reject(address, f"the attestation call failed: {e.code().name}: {e.details()}")
        if reply.address != address:
            return self._reject(address, f"it attested for address {reply.address!r} (relayed?), not the one dialled "
                                         "(set the worker's --advertise-address to what the router dials)")
        if not verify_attestation(token, nonce, reply.worker_id, address, reply.mac):
            return self._reject(address, "its attestation does not verify with the cluster token")
        return Admission(Verdict.ADMITTED)

    def _reject(self, address: str, why: str) -> Admission:
        reason = f"REJECTED worker at {address}: {why}; it will get no requests"
        log.warning("kvmesh router: %s", reason)
        return Admission(Verdict.REJECTED, reason)

    def _warn_open(self) -> None:
        if self._warned or self.checks:
            return
        self._warned = True
        log.warning("kvmesh router: no --cluster-token and no --tls-ca: every worker registered in Redis or "
                    "named by --worker is admitted unchecked (fine on loopback; see README: Security)")
