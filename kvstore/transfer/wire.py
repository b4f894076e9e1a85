"""The wire format of a block transfer (see `kvstore.transfer.blocks`): the block shape, the
per-block checksums (streaming, so a receiver verifies piece by piece), the body encoding,
the layer-contiguous pieces a payload is cut into, and where the bytes travel."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import xxhash

from kvstore.keys import BlockHash
from kvstore.transfer.group import PairGroup

WIRE_VERSION = 2                         # 1: no READY, gloo pieces posted after the preamble arrived
MAGIC = (0x6B766D657368 << 8) | WIRE_VERSION  # "kvmesh" + the version: a v1 peer's preamble never matches
TAGS = 11                                # tags per transfer, at these offsets from TAGS * transfer_id:
PREAMBLE, BODY, FIRST_PIECE = 0, 1, 2    # (sender -> receiver)
MAX_PIECES = 8                           # pieces at FIRST_PIECE .. FIRST_PIECE + MAX_PIECES - 1
READY = FIRST_PIECE + MAX_PIECES         # (receiver -> sender, gloo only) its expected preamble
MAX_TRANSFER_ID = (1 << 27) - 1          # gloo tags are C ints; measurements use tags above these
_U64 = 1 << 64
_PIECE_BYTES = 8 << 20                   # pieces of at least ~8 MiB: few per-op costs, most hashing overlapped


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One block on the wire: `[num_layers, 2, block_size, H, last_dim]` of `dtype`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    last_dim: int  # head_dim, or slot_bytes for a quantized pool
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "last_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")

    @classmethod
    def of(cls, kv: torch.Tensor) -> BlockSpec:
        """The spec of a pool's `kv` tensor or of gathered blocks `[L, 2, n, bs, H, D]`."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"kv.shape={tuple(kv.shape)}; expected [L, 2, n, block_size, H, D]")
        num_layers, _, _, block_size, num_kv_heads, last_dim = kv.shape
        return cls(num_layers, block_size, num_kv_heads, last_dim, kv.dtype)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.last_dim)

    @property
    def chunk_bytes(self) -> int:
        """Contiguous bytes of one block in one (layer, K|V) plane."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.last_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.chunk_bytes


class RecvTimes(NamedTuple):
    """Where a receive's time went, in seconds from the `recv` call: the first and the last
    piece in, and the end; `hashing_s` is the time spent verifying (all but the last piece's
    overlaps the wire)."""

    first_piece_s: float
    last_piece_s: float
    hashing_s: float
    total_s: float


class ReceivedBlocks(NamedTuple):
    """What arrived: `blocks` `[L, 2, n, bs, H, D]` (owned by the caller), their hashes, and
    `ok[j]` False where block j failed its checksum (its bytes must not be used)."""

    blocks: torch.Tensor
    block_hashes: tuple[BlockHash, ...]
    ok: tuple[bool, ...]
    times: RecvTimes | None = None

    @property
    def bad_indices(self) -> list[int]:
        return [j for j, good in enumerate(self.ok) if not good]


class SendResult(NamedTuple):
    """A completed send: the peer holds the bytes (not yet verified them)."""

    num_blocks: int
    num_bytes: int
    seconds: float
    hashing_s: float = 0.0   # of `seconds`, spent on the checksums (overlapping the wire)


class ChecksumKernel(Protocol):
    """Per-block XXH3-64 streams in native code (`worker.kernels.native.checksum_kernel()`;
    kvstore imports no worker code): bit-equal to the python path, for blocks of more than
    `NATIVE_MIN_BLOCK_BYTES` bytes. The state is an int64 tensor, one row per block."""

    def xxh3_blocks_init(self, n: int) -> torch.Tensor: ...

    def xxh3_blocks_update(self, state: torch.Tensor, piece: torch.Tensor, total: int) -> None:
        """Feed `piece` uint8 `[planes, n, chunk]` (block j: the j-th chunk of each plane) to
        blocks of `total` bytes."""

    def xxh3_blocks_digest(self, state: torch.Tensor, total: int) -> torch.Tensor:
        """int64 [n]: the uint64 digests' bits, once every block got its `total` bytes."""


NATIVE_MIN_BLOCK_BYTES = 241             # the kernel implements XXH3's long-input path only


class BlockHashers:
    """Streaming xxh3_64 of each block of a `[L, 2, n, ...]` payload fed in layer order, one
    contiguous `[l, 2, n, ...]` piece at a time (the digests do not depend on the cut). With a
    `kernel`, one native call per piece (GIL released); else one python `update` per (plane,
    block) chunk. Both give the same digests, so either side of a transfer may lack the kernel."""

    def __init__(self, num_blocks: int, bytes_per_block: int, kernel: ChecksumKernel | None = None) -> None:
        self._n, self._total = num_blocks, bytes_per_block
        self._kernel = kernel if bytes_per_block >= NATIVE_MIN_BLOCK_BYTES else None
        if self._kernel is not None:
            self._state = self._kernel.xxh3_blocks_init(num_blocks)
        else:
            self._hashers = [xxhash.xxh3_64() for _ in range(num_blocks)]

    @property
    def native(self) -> bool:
        return self._kernel is not None

    def update(self, piece: torch.Tensor) -> None:
        assert piece.is_contiguous() and piece.device.type == "cpu" and piece.numel() > 0
        n = self._n
        planes = piece.reshape(-1).view(torch.uint8).view(piece.shape[0] * 2, n, -1)   # [planes, n, chunk]
        if self._kernel is not None:
            self._kernel.xxh3_blocks_update(self._state, planes, self._total)
            return
        # rows of a numpy view are the cheapest buffers to hand xxhash
        updates = [h.update for h in self._hashers]
        for plane in planes.numpy():
            for update, chunk in zip(updates, plane):
                update(chunk)

    def digests(self) -> list[int]:
        if self._kernel is not None:
            return [_u64(v) for v in self._kernel.xxh3_blocks_digest(self._state, self._total).tolist()]
        return [h.intdigest() for h in self._hashers]


def block_checksums(payload: torch.Tensor, num_blocks: int, kernel: ChecksumKernel | None = None) -> list[int]:
    """xxh3_64 of each block's bytes in a contiguous `[L, 2, n, ...]` payload (host memory).

    Block j's bytes are the j-th chunk of each of the 2L (layer, K|V) planes."""
    hashers = BlockHashers(num_blocks, payload.numel() * payload.element_size() // num_blocks, kernel)
    hashers.update(payload)
    return hashers.digests()


def num_pieces(spec: BlockSpec, num_blocks: int) -> int:
    """How many layer-contiguous pieces a payload goes out in (both sides compute it)."""
    nbytes = num_blocks * spec.bytes_per_block
    return max(1, min(MAX_PIECES, spec.num_layers, nbytes // _PIECE_BYTES))


def split_pieces(blocks: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`blocks` `[L, 2, n, ...]` cut along dim 0 into `count` contiguous views."""
    return list(torch.tensor_split(blocks, count, dim=0))


def _i64(u: int) -> int:
    return u - _U64 if u >= 1 << 63 else u


def _u64(i: int) -> int:
    return i + _U64 if i < 0 else i


def encode_body(checksums: Sequence[int], hashes: Sequence[int]) -> torch.Tensor:
    values = [_i64(c) for c in checksums] + [_i64(h >> 64) for h in hashes] \
        + [_i64(h & (_U64 - 1)) for h in hashes]
    return torch.tensor(values, dtype=torch.int64)  # [3n]


def decode_body(body: torch.Tensor, n: int) -> tuple[list[int], list[BlockHash]]:
    vals = [_u64(v) for v in body.tolist()]
    return vals[:n], [BlockHash((hi << 64) | lo) for hi, lo in zip(vals[n:2 * n], vals[2 * n:])]


def wire_device(pair: PairGroup) -> torch.device:
    """Where bytes travel: the pair's device, except CUDA over gloo (pinned host memory)."""
    return torch.device("cpu") if pair.backend == "gloo" else pair.device


def to_wire(blocks: torch.Tensor, wire: torch.device) -> torch.Tensor:
    if blocks.device == wire:
        return blocks
    staged = torch.empty(blocks.shape, dtype=blocks.dtype, device=wire, pin_memory=True)
    staged.copy_(blocks)    # CUDA -> pinned host, for gloo (not run here: no GPU)
    return staged
