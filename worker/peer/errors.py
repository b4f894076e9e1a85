"""The errors of peer transfer that a caller handles (worker/server/status.py maps them to gRPC
codes). Torch-free."""
from __future__ import annotations


class PeerError(Exception):
    """Base of the peer-transfer errors a caller handles."""


class InvalidPeerRequest(PeerError, ValueError):
    """A SendBlocks request this worker cannot serve as sent (gRPC INVALID_ARGUMENT)."""


class PeerTransferOff(PeerError):
    """This worker has no peer plane (gRPC FAILED_PRECONDITION)."""


class PeerUnavailable(PeerError):
    """The peer's control plane did not answer (down, refused, timed out)."""
