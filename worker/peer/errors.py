"""The errors of peer transfer that a caller handles (worker/server/status.py maps them to gRPC
codes). Torch-free."""
from __future__ import annotations

import enum
from typing import NamedTuple


class PeerError(Exception):
    """Base of the peer-transfer errors a caller handles."""


class InvalidPeerRequest(PeerError, ValueError):
    """A SendBlocks request this worker cannot serve as sent (gRPC INVALID_ARGUMENT)."""


class PeerTransferOff(PeerError):
    """This worker has no peer plane (gRPC FAILED_PRECONDITION)."""


class PeerUnavailable(PeerError):
    """The peer's control plane did not answer (down, refused, timed out)."""


class FetchCause(enum.Enum):
    """Why a fetch that was tried brought nothing usable (the `cause` label of the worker's
    hand-off failure metric)."""

    UNAVAILABLE = "unavailable"     # the peer's control plane did not answer (down, refused, timed out)
    NOT_HELD = "not_held"           # the peer holds none of the blocks (evicted, never computed)
    TRANSFER = "transfer"           # forming the pair or the transfer itself failed (lost peer, timeout)
    BAD_CHECKSUM = "bad_checksum"   # the first block arrived corrupted
    TIMEOUT = "timeout"             # a hand-off's `timeout_s` ran out (worker/server/generate_stream.py)


class FetchFailure(NamedTuple):
    cause: FetchCause
    why: str
