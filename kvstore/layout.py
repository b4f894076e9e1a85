"""Bytes of KV cache per token, block, sequence and batch — the primer's formula.

    KV_cache_bytes = 2 × num_layers × num_kv_heads × head_dim × seq_len × batch × bytes_per_element

Every allocation in kvmesh (the planner, the paged tensors, the host tier) derives its size
from `KVLayout`, so what the planner promises is what the allocator takes.

Quantized dtypes store, per (layer, K or V, token, kv head), the packed values plus an fp16
scale (int8, fp8; int4: one per group of 16 values, two values per byte). That overhead is
counted here, not hidden.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int8", "int4")


class KVQuant(enum.Enum):
    """How one K or V element is stored in the pool."""

    NONE = "none"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"


# element bits and per-(token, head) metadata bytes for each concrete KV dtype
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
_META_BYTES = {"fp32": 0, "fp16": 0, "bf16": 0, "fp8": 2, "int8": 2, "int4": 2}
_QUANT = {"fp32": KVQuant.NONE, "fp16": KVQuant.NONE, "bf16": KVQuant.NONE,
          "fp8": KVQuant.FP8, "int8": KVQuant.INT8, "int4": KVQuant.INT4}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """`auto` means: store KV in the model's compute dtype (fp32 | fp16 | bf16)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; accepted: {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if model_dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"model_dtype={model_dtype!r}; accepted: fp32, fp16, bf16")
    return model_dtype


INT4_GROUP = 16


def int4_group_size(head_dim: int) -> int:
    """Values per int4 scale: 16 when it divides head_dim, else the whole vector."""
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and storage of one model's KV cache. `kv_cache_dtype` is concrete (not `auto`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    kv_cache_dtype: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.kv_cache_dtype not in _BITS:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}; accepted: {', '.join(_BITS)} "
                "(resolve 'auto' with resolve_kv_cache_dtype first)")
        if self.kv_cache_dtype == "int4" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for int4 (two values per byte)")

    @property
    def quant(self) -> KVQuant:
        return _QUANT[self.kv_cache_dtype]

    @property
    def head_bytes(self) -> int:
        """Packed value bytes of one head of one token (K or V)."""
        return self.head_dim * _BITS[self.kv_cache_dtype] // 8

    @property
    def head_meta_bytes(self) -> int:
        """Scale bytes of one head of one token (K or V); 0 unquantized.
        int4 has one fp16 scale per group of `int4_group_size` values."""
        if self.kv_cache_dtype == "int4":
            return _META_BYTES["int4"] * (self.head_dim // int4_group_size(self.head_dim))
        return _META_BYTES[self.kv_cache_dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * (self.head_bytes + self.head_meta_bytes)

    @property
    def bytes_per_token(self) -> int:
        """2 × layers × kv_heads × head_dim × bytes (+ quantization metadata)."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (the last one may be partly used)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        return math.ceil(num_tokens / self.block_size)

    def bytes_per_sequence(self, num_tokens: int, paged: bool = True) -> int:
        """Bytes one sequence of `num_tokens` occupies; paged rounds up to whole blocks."""
        if paged:
            return self.blocks_for(num_tokens) * self.bytes_per_block
        return num_tokens * self.bytes_per_token

    def bytes_for_batch(self, num_tokens: int, batch: int, paged: bool = True) -> int:
        if batch < 0:
            raise ValueError(f"batch={batch} must be >= 0")
        return batch * self.bytes_per_sequence(num_tokens, paged)

    def num_blocks_in(self, num_bytes: int) -> int:
        """How many whole blocks fit in `num_bytes`."""
        return max(0, num_bytes // self.bytes_per_block)
