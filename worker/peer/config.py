"""What the peer plane (worker/peer/plane.py) is configured with and reports, and what it
exchanges with the server: the control-plane call of a fetch (`AskPeer`, answered by an
`AskAnswer`) and a fetch's verified blocks (`Fetched`)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.keys import BlockHash
from kvstore.transfer.cost import LinkEstimate
from kvstore.transfer.group import PeerId, TransferConfig
from worker.engine.commands import StageBlocks


class AskAnswer(NamedTuple):
    num_blocks: int          # blocks the peer will send (0: none)
    generation: int          # the peer's generation
    pair_unknown: bool       # the peer holds no live pair under the key asked with


AskPeer = Callable[[str, Sequence[BlockHash], int, dict[str, Any]], Awaitable[AskAnswer]]
"""`ask(address, block_hashes, transfer_id, pair_fields)` → the peer's answer; raises
PeerUnavailable. `pair_fields` are SendBlocksRequest's pair fields. (The gRPC call is
worker/server/cluster_auth.py `PeerCalls.ask`.)"""


class Fetched(NamedTuple):
    """Verified blocks from a peer: `staged` puts them in the host tier (sent with the
    request's AddRequest; None: they were staged as they arrived, worker/peer/handoff.py);
    they are prompt blocks `num_local .. num_local + num_blocks`."""

    staged: StageBlocks | None
    num_local: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Where this worker hosts its rendezvous store (`store_host`:`store_port`, 0 = a free
    port; peers dial `advertise_host` or `store_host`), how transfers and pairs time out, and
    how the worker measures itself for the cost model. `faults` (tests only): one action per
    send of this worker, in order — "ok", "corrupt:J" (flip a byte of block J after its
    checksum was taken) or "exit" (end the process before the payload goes out)."""

    worker_id: str
    transfer: TransferConfig = TransferConfig()
    store_host: str = "127.0.0.1"
    store_port: int = 0
    advertise_host: str | None = None
    prefill_probe_tokens: int = 64
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_probe_tokens, int) or self.prefill_probe_tokens < 1:
            raise ValueError(f"prefill_probe_tokens={self.prefill_probe_tokens!r} must be a positive integer")
        if not isinstance(self.store_port, int) or not 0 <= self.store_port <= 65535:
            raise ValueError(f"store_port={self.store_port!r} must be in [0, 65535] (0 = a free port)")
        for action in self.faults:
            if action not in ("ok", "exit") and not (action.startswith("corrupt:") and action[8:].isdigit()):
                raise ValueError(f"faults: {action!r}; accepted: ok, corrupt:J, exit")


@dataclass(slots=True)
class PeerCounters:
    """What happened since start (mutated under the plane's lock; `figures` hands out a copy)."""

    fetch_decisions: int = 0
    recompute_decisions: int = 0
    blocks_fetched: int = 0
    bytes_fetched: int = 0
    blocks_bad: int = 0
    fetch_failures: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    send_failures: int = 0
    fetch_seconds: float = 0.0
    last_decision: str = ""
    last_fetch_estimate_s: float = 0.0
    last_recompute_estimate_s: float = 0.0


class PeerFigures(NamedTuple):
    """What the cost model decides with, and the counters (see proto PeerStats)."""

    me: PeerId
    store_address: str
    backend: str
    prefill_tokens_per_s: float
    checksum_bytes_s: float
    links: dict[str, LinkEstimate]        # peer worker id -> its last measured link
    lost: dict[str, str]                  # peer worker id -> why its last pair broke
    pairs_formed: int
    pairs_broken: int
    counters: PeerCounters
