"""The cluster token: the one secret the router and the workers share.

`--cluster-token` / `KVMESH_CLUSTER_TOKEN` (`kvmesh serve` makes one per start). It is
- sent by the router (and by a worker asking a peer) as gRPC metadata `x-kvmesh-cluster-token`
  on every `kvmesh.v1.Worker` call once the worker has been admitted; a worker holding a token
  refuses (UNAUTHENTICATED) any Worker call without it, health and reflection aside;
- never sent to a worker before that worker has proved it holds the token too: the router's
  admission handshake (`Worker/Attest`) asks for `attestation_mac` over a fresh nonce, the
  worker's id and the address it advertises, so a fake worker registered in Redis cannot
  answer, and a real worker's answer relayed by a fake one names the wrong address.

Tokens are compared with `hmac.compare_digest`; `masked` is how one may appear in output.
Torch- and gRPC-free.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

TOKEN_ENV = "KVMESH_CLUSTER_TOKEN"
TOKEN_METADATA = "x-kvmesh-cluster-token"
NONCE_BYTES = 32
_MIN_TOKEN_CHARS = 16


def new_token() -> str:
    """A fresh token (`kvmesh serve`, once per start)."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    """`token` if usable; ValueError naming cluster_token (never echoing it) otherwise."""
    if not isinstance(token, str) or len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token) \
            or not token.isascii():
        raise ValueError(f"cluster_token: must be at least {_MIN_TOKEN_CHARS} printable ASCII characters "
                         "without whitespace")
    return token


def token_from(flag: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The --cluster-token value, else $KVMESH_CLUSTER_TOKEN, else None; ValueError if unusable."""
    raw = flag if flag else env.get(TOKEN_ENV) or None
    return None if raw is None else check_token(raw.strip())


def masked(secret: str) -> str:
    """How a secret may be shown: its first 4 characters and its length."""
    return f"{secret[:4]}…({len(secret)} chars)"


def token_matches(presented: str | bytes | None, token: str) -> bool:
    """Constant-time comparison of a presented metadata value with the token."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(presented, token.encode("ascii"))


def attestation_mac(token: str, nonce: bytes, worker_id: str, address: str) -> bytes:
    """HMAC-SHA256 of the handshake: binds the router's nonce to the worker's id and address."""
    message = b"kvmesh-attest-v1\0" + nonce + b"\0" + worker_id.encode() + b"\0" + address.encode()
    return hmac.new(token.encode("ascii"), message, hashlib.sha256).digest()


def verify_attestation(token: str, nonce: bytes, worker_id: str, address: str, mac: bytes) -> bool:
    return hmac.compare_digest(attestation_mac(token, nonce, worker_id, address), mac)


def add_cluster_auth_arguments(p: argparse.ArgumentParser, role: str, token_help: str) -> None:
    """The "cluster authentication" flags of `role` (router, worker, serve): `--cluster-token`
    (its meaning for that role in `token_help`) and the TLS files (contracts.tls)."""
    from contracts.tls import add_tls_arguments
    g = p.add_argument_group("cluster authentication (README: Security)")
    g.add_argument("--cluster-token", default=None, metavar="TOKEN",
                   help=f"{token_help} (default: ${TOKEN_ENV}; prefer the environment: flags show in ps)")
    add_tls_arguments(g, role)
