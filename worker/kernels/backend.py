"""Which kernels run attention: `--attention-backend auto|torch|native|triton`.

| backend | write_kv / paged_attention                                                     |
|---------|--------------------------------------------------------------------------------|
| torch   | `reference` (gather + SDPA): the oracle, any device and dtype                  |
| native  | `reference`, with fp32 decode rows on CPU read in place by the C++ kernel      |
|         | (`worker.kernels.native`); everything else the torch path. A pure fp32 decode  |
|         | step runs RoPE + write_kv + attention of a layer as one call (`rope_decode`)   |
| triton  | `triton_attention`: Triton kernels reading the paged cache in place (CUDA; on  |
|         | CPU only under `TRITON_INTERPRET=1`, the interpreter the tests use)            |
| auto    | triton on CUDA, native on CPU when the native kernels are built, else torch    |

`resolve_backend` turns a request into a concrete backend for a device once, at engine
start (the engine reports it: `kvmesh bench engine` JSON, the worker's model info);
`attention_ops` gives the two functions the model calls. Triton is imported only when the
triton backend is chosen.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvstore.quant import KVCache
from worker.kernels import native, reference
from worker.kernels.reference import AttnMetadata
from worker.kernels.triton_env import triton_available, triton_interpreted


class AttentionBackend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    NATIVE = "native"
    TRITON = "triton"


ATTENTION_BACKENDS = tuple(b.value for b in AttentionBackend)

WriteKV = Callable[[torch.Tensor, torch.Tensor, KVCache, KVCache, torch.Tensor], None]
PagedAttention = Callable[[torch.Tensor, KVCache, KVCache, AttnMetadata, float, "int | None"], torch.Tensor]
# (qkv [T, (Hq + 2 Hkv) D], (cos, sin_signed), k_cache, v_cache, meta, scale, sliding_window, num_heads)
# -> [T, Hq * D], or None where the fused kernel does not apply
RopeDecode = Callable[[torch.Tensor, "tuple[torch.Tensor, torch.Tensor]", KVCache, KVCache, AttnMetadata, float,
                       "int | None", int], "torch.Tensor | None"]


class AttentionOps(NamedTuple):
    """The attention functions of one backend (the signatures of `reference`'s).

    `rope_decode`, where a backend has one, runs a decode step's RoPE, write_kv and
    paged_attention of one layer as one kernel (the model calls it first and runs the three
    itself when it returns None); None: the backend has no such kernel.
    """

    backend: AttentionBackend
    write_kv: WriteKV
    paged_attention: PagedAttention
    rope_decode: RopeDecode | None = None


def parse_backend(name: str | AttentionBackend) -> AttentionBackend:
    """`name` as an AttentionBackend; ValueError naming the accepted values."""
    if isinstance(name, AttentionBackend):
        return name
    try:
        return AttentionBackend(name)
    except ValueError:
        raise ValueError(f"attention_backend={name!r}; accepted: {', '.join(ATTENTION_BACKENDS)}") from None


def resolve_backend(requested: str | AttentionBackend, device: torch.device) -> AttentionBackend:
    """The concrete backend for `device`; ValueError when the request cannot run there."""
    backend = parse_backend(requested)
    cuda = device.type == "cuda"
    if backend is AttentionBackend.AUTO:
        if cuda:
            return AttentionBackend.TRITON if triton_available() else AttentionBackend.TORCH
        return AttentionBackend.NATIVE if native.load() is not None else AttentionBackend.TORCH
    if backend is AttentionBackend.TRITON:
        if not triton_available():
            raise ValueError("attention_backend=triton: the triton package is not installed")
        if not cuda and not triton_interpreted():
            raise ValueError(f"attention_backend=triton needs a CUDA device (device is {device}); "
                             "on CPU only the Triton interpreter runs it (TRITON_INTERPRET=1, for tests)")
    if backend is AttentionBackend.NATIVE:
        if cuda:
            raise ValueError("attention_backend=native is the CPU kernel; on CUDA use triton or torch")
        if native.load() is None:
            raise ValueError("attention_backend=native: the native CPU kernels are not built "
                             "(python -m worker.kernels.native says why)")
    return backend


def _torch_attention(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttnMetadata,
                     scale: float, sliding_window: int | None = None) -> torch.Tensor:
    return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, allow_native=False)


def _native_rope_decode(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: KVCache,
                        v_cache: KVCache, meta: AttnMetadata, scale: float, sliding_window: int | None,
                        num_heads: int) -> torch.Tensor | None:
    """`native.rope_paged_decode` for a step of decode rows only, without score collection."""
    if meta.score_acc is not None or not meta.is_decode \
            or not native.rope_decode_supported(qkv, k_cache, v_cache, num_heads):
        return None
    return native.rope_paged_decode(qkv, rope[0], rope[1], k_cache, v_cache, meta.slot_mapping,  # type: ignore[arg-type]
                                    meta.block_tables, meta.seq_lens, scale, sliding_window, num_heads)


def attention_ops(backend: AttentionBackend) -> AttentionOps:
    """The functions of a concrete backend (resolve AUTO first)."""
    if backend is AttentionBackend.TORCH:
        return AttentionOps(backend, reference.write_kv, _torch_attention)
    if backend is AttentionBackend.NATIVE:
        return AttentionOps(backend, reference.write_kv, reference.paged_attention, _native_rope_decode)
    if backend is AttentionBackend.TRITON:
        from worker.kernels import triton_attention
        return AttentionOps(backend, triton_attention.write_kv, triton_attention.paged_attention)
    raise ValueError(f"attention_ops({backend}): resolve {AttentionBackend.AUTO} with resolve_backend first")
