"""The paged K/V tensors of one pool on one device, sized from `KVLayout`.

All layers live in ONE tensor `kv` of shape `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]` (index 0 of dim 1 is K, 1 is V). Per-layer `k_caches[i]` /
`v_caches[i]` are views of it, each `[num_blocks, block_size, num_kv_heads, head_dim]` and
contiguous, so a kernel can flatten them to slots (`slot = block_id * block_size + offset`).
Because the block dimension is shared by every layer, moving whole blocks (copy-on-write,
offload to a host tier, peer transfer) is one index op over all layers at once.

The pool is zero-filled: kernels gather whole blocks and mask what they do not use, and a
masked slot holding NaN/Inf garbage would still poison `probs @ V` (0 * NaN = NaN).

Quantized layouts (fp8 / int8 / int4, see `kvstore.quant`) keep the same single backing
tensor, in bytes: `kv` is uint8 `[num_layers, 2, num_blocks, block_size, H, slot_bytes]`
where a slot holds one head vector's packed values followed by its fp16 scale (and zero
point), `slot_bytes = layout.head_bytes + layout.head_meta_bytes`. `k_caches[i]` /
`v_caches[i]` are then `QuantizedKV(slots, codec)` over the views `kv[i, 0]` / `kv[i, 1]`.
Values and scales sharing one tensor keeps every block move one op (the host tier and
peer transfer see plain bytes) and lets a kernel gather a block's values and scales with
one index_select.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvstore.layout import KVLayout, KVQuant
from kvstore.quant import KVCache, KVCodec, QuantizedKV

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

BlockIds = Sequence[int] | torch.Tensor

_BLOCK_DIM = 2  # of `kv`: [num_layers, 2, num_blocks, block_size, H, D]


def torch_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch element dtype of an unquantized KV cache dtype (fp32 | fp16 | bf16)."""
    if kv_cache_dtype not in _TORCH_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} has no plain torch dtype; "
            f"accepted: {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[kv_cache_dtype]


class LayerKV(NamedTuple):
    """The K and V caches of one layer, each `[num_blocks, block_size, num_kv_heads, head_dim]`
    (a `QuantizedKV` of that logical shape when the layout is quantized)."""

    k_cache: KVCache
    v_cache: KVCache


class KVTensors:
    """Paged K/V storage for every layer of one model in one pool on one device.

    Holds no bookkeeping: which block belongs to whom is the block pool's business
    (`kvstore.pool`); this class only owns the memory and moves blocks by id.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # codec is None for plain dtypes; then `kv` holds elements of `dtype`, else slot bytes
        self.codec = None if layout.quant is KVQuant.NONE else KVCodec.for_layout(layout)
        self.dtype = torch_dtype(layout.kv_cache_dtype) if self.codec is None else torch.uint8
        last = layout.head_dim if self.codec is None else self.codec.slot_bytes
        self.kv = torch.zeros(  # [num_layers, 2, num_blocks, block_size, H, D | slot_bytes]
            layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, last,
            dtype=self.dtype, device=self.device)
        self.k_caches: tuple[KVCache, ...] = tuple(self._cache(self.kv[i, 0]) for i in range(layout.num_layers))
        self.v_caches: tuple[KVCache, ...] = tuple(self._cache(self.kv[i, 1]) for i in range(layout.num_layers))

    def _cache(self, view: torch.Tensor) -> KVCache:
        return view if self.codec is None else QuantizedKV(view, self.codec)

    @classmethod
    def for_budget(cls, layout: KVLayout, num_bytes: int, device: str | torch.device = "cpu") -> KVTensors:
        """As many whole blocks as fit in `num_bytes` (at least one, else ValueError)."""
        num_blocks = layout.num_blocks_in(num_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"num_bytes={num_bytes} does not hold one block ({layout.bytes_per_block} bytes)")
        return cls(layout, num_blocks, device)

    @property
    def _backing(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds pool state; each has the block id at dim `_BLOCK_DIM`."""
        return (self.kv,)

    @property
    def nbytes(self) -> int:
        """Bytes of all backing tensors; equals `layout.bytes_per_block * num_blocks`."""
        return sum(t.numel() * t.element_size() for t in self._backing)

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def layer(self, layer_idx: int) -> LayerKV:
        return LayerKV(self.k_caches[layer_idx], self.v_caches[layer_idx])

    def copy_blocks(self, src_ids: BlockIds, dst_ids: BlockIds) -> None:
        """Copy blocks `src_ids[j] -> dst_ids[j]` in every layer, K and V (copy-on-write).

        All reads happen before any write, so overlapping src/dst sets are safe. `dst_ids`
        must not repeat an id.
        """
        src = self._as_index(src_ids, "src_ids")
        dst = self._as_index(dst_ids, "dst_ids", unique=True)
        if src.numel() != dst.numel():
            raise ValueError(f"len(src_ids)={src.numel()} != len(dst_ids)={dst.numel()}")
        for t in self._backing:
            t.index_copy_(_BLOCK_DIM, dst, t.index_select(_BLOCK_DIM, src))

    def gather_blocks(self, block_ids: BlockIds) -> torch.Tensor:
        """A copy of the blocks: `[num_layers, 2, len(block_ids), block_size, H, D | slot_bytes]`
        in `self.dtype` (uint8 slot bytes when quantized: scales travel with their values)."""
        return self.kv.index_select(_BLOCK_DIM, self._as_index(block_ids, "block_ids"))

    def scatter_blocks(self, block_ids: BlockIds, data: torch.Tensor) -> None:
        """Write `data` (as returned by `gather_blocks`) into the blocks `block_ids`."""
        idx = self._as_index(block_ids, "block_ids", unique=True)
        expected = (self.kv.shape[0], 2, idx.numel(), *self.kv.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"data.shape={tuple(data.shape)}; expected {expected}")
        if data.dtype != self.dtype:
            raise ValueError(f"data.dtype={data.dtype}; expected {self.dtype}")
        self.kv.index_copy_(_BLOCK_DIM, idx, data.to(self.device, non_blocking=True))

    def _as_index(self, block_ids: BlockIds, name: str, unique: bool = False) -> torch.Tensor:
        """Block ids as an int64 index on this device; a Python sequence is range-checked."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be a 1-D integer tensor; got {block_ids.dtype} "
                                 f"{tuple(block_ids.shape)}")
            idx = block_ids.to(self.device, torch.int64)
            # a device tensor is not range-checked here: that would force a host sync
            if unique and idx.device.type == "cpu" and idx.unique().numel() != idx.numel():
                raise ValueError(f"{name} repeats a block id")
            return idx
        ids = list(block_ids)
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{name} has ids outside [0, {self.num_blocks}): {bad[:8]}")
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"{name} repeats a block id")
        return torch.tensor(ids, dtype=torch.int64, device=self.device)
