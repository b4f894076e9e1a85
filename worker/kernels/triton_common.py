"""What the Triton kernels share: how a paged cache is described to a launch, and the
in-register (de)quantization of one slot.

A cache is either a plain tensor `[num_blocks, block_size, Hkv, D]` (fp32 | fp16 | bf16) or
a `kvstore.quant.QuantizedKV` whose slots `[num_blocks, block_size, Hkv, slot_bytes]` (uint8)
hold a head vector's packed values followed by its fp16 scale(s) (see `kvstore.quant`):

| quant | element d of a slot                                 | scale of element d          |
|-------|-----------------------------------------------------|-----------------------------|
| int8  | byte d as int8                                      | fp16 at bytes hb, hb+1      |
| fp8   | byte d as float8 e4m3fn                             | fp16 at bytes hb, hb+1      |
| int4  | nibble d % 2 of byte d // 2, as INT4_LEVELS[nibble] | fp16 number d // group      |

(hb = head_bytes). Scales are assembled from two byte loads, so no slot width needs any
alignment. fp8 is encoded and decoded with integer arithmetic rather than the hardware
conversion: the Triton interpreter's float8 conversion truncates instead of rounding to
nearest even, and the tests compare the interpreter's bytes with torch's exactly.

The rotation fp8 and int4 apply (`KVCodec.rotation`) is not done in the kernels: the
wrappers multiply by R in torch exactly where the reference does (keys and values before
they are quantized, the query before attention, the output after), so the stored bytes and
the attention are the reference's.

Triton is imported here; this module is only imported by the Triton backend (never on a
CPU worker unless `TRITON_INTERPRET=1` was chosen for tests).
"""
from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvstore.layout import KVQuant
from kvstore.quant import INT4_LEVELS, KVCache, QuantizedKV
from worker.kernels.triton_env import triton_interpreted


class Quant(enum.IntEnum):
    """The `QUANT` constexpr every kernel specialises on."""

    NONE = 0
    INT8 = 1
    FP8 = 2
    INT4 = 3


_QUANT = {KVQuant.INT8: Quant.INT8, KVQuant.FP8: Quant.FP8, KVQuant.INT4: Quant.INT4}


class CacheArgs(NamedTuple):
    """One layer's K or V cache as a kernel takes it (strides in elements of `data`)."""

    data: torch.Tensor  # the cache tensor, or the slot bytes of a quantized one
    quant: Quant
    head_dim: int
    head_bytes: int  # packed value bytes of a slot (0 for a plain cache)
    group: int  # values per scale (head_dim unless int4)
    stride_block: int
    stride_token: int
    stride_head: int


def cache_args(cache: KVCache) -> CacheArgs:
    """Describe `cache` for a launch; asserts the innermost dim is contiguous."""
    if isinstance(cache, QuantizedKV):
        codec = cache.codec
        data = cache.slots
        quant, head_bytes, group = _QUANT[codec.quant], codec.head_bytes, codec.group_size
    else:
        data, quant, head_bytes, group = cache, Quant.NONE, 0, cache.shape[3]
    assert data.dim() == 4 and data.stride(3) == 1, (data.shape, data.stride())
    return CacheArgs(data, quant, cache.shape[3], head_bytes, group, data.stride(0), data.stride(1), data.stride(2))


def next_pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels run `tl.dot` on fp32 operands (IEEE) for queries of `dtype`.

    fp32 queries always do (no TF32). bf16 ones do only under the Triton interpreter, whose
    `tl.dot` multiplies bf16 as raw uint16 bit patterns; compiled, bf16 goes to the tensor
    cores like fp16. The operands are the same bf16-rounded values either way.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton_interpreted())


@functools.lru_cache(maxsize=32)
def levels(query_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """INT4_LEVELS rounded to the reference's decode dtype (fp16 for fp16 queries), as fp32.

    `KVCodec.decode` computes `LEVELS[q] * scale` in fp16 for fp16 and in fp32 otherwise; an
    fp16 x fp16 product is exact in fp32, so rounding the levels the same way and multiplying
    in fp32 gives the reference's values once cast to the query dtype.
    """
    compute = torch.promote_types(query_dtype, torch.float16)
    return torch.tensor(INT4_LEVELS, dtype=compute, device=device).float()


@functools.lru_cache(maxsize=16)
def int4_midpoints(device: torch.device) -> torch.Tensor:
    """[16] fp32: the 15 decision boundaries between adjacent INT4_LEVELS (as
    `kvstore.quant` computes them), then +inf so a kernel can load 16."""
    lv = torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device)
    return torch.cat(((lv[1:] + lv[:-1]) / 2, torch.tensor([float("inf")], device=device)))


# -- jit helpers ----------------------------------------------------------------------------
@triton.jit
def rne(x):
    """Round fp32 `x` (|x| < 2**22) to the nearest integer, ties to even (torch.round's rule)."""
    magic = 12582912.0  # 1.5 * 2**23: adding it leaves no fraction bits
    return (x + magic) - magic


@triton.jit
def pow2(e):
    """2.0 ** e for an int32 tensor e in [-126, 127], exactly (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_encode(y):
    """fp32 `y` (|y| <= 448) -> float8 e4m3fn bits as int32, rounded to nearest even.

    With e = max(floor(log2 |y|), -6), |y| rounds to m * 2**(e - 3) with m an integer in
    [0, 16]; its code is (e + 6) * 8 + m, which also covers subnormals (e = -6, m < 8) and a
    rounding up into the next binade (m = 16).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    m = rne(a * pow2(3 - e)).to(tl.int32)
    return (sign << 7) | ((e + 6) * 8 + m)


@triton.jit
def fp8_decode(code):
    """float8 e4m3fn bits (int32, 0..255, no NaN codes) -> fp32, exactly."""
    e = (code >> 3) & 0xF
    m = (code & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2(tl.maximum(e, 1) - 10))  # 2**-9: subnormal step
    return tl.where((code & 0x80) != 0, -mag, mag)


@triton.jit
def load_fp16_bytes(ptr, mask):
    """An fp16 stored as two bytes at `ptr`, `ptr + 1` (little-endian), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_kv_tile(base_ptr, row, row_mask, offs_d, d_mask, levels_ptr,
                 QUANT: tl.constexpr, HEAD_BYTES: tl.constexpr, GROUP: tl.constexpr):
    """Cached head vectors `[N, D_PAD]`: `row` [N] int64 offset of each slot, `row_mask` [N],
    `offs_d` and `d_mask` [D_PAD]; masked elements are 0. A plain cache's values come in its
    own dtype (no fp32 copy of a tile in registers); quantized ones are dequantized to fp32."""
    r = row[:, None]
    d = offs_d[None, :]
    mask = row_mask[:, None] & d_mask[None, :]
    if QUANT == 0:
        x = tl.load(base_ptr + r + d, mask=mask, other=0.0)
    elif QUANT == 3:
        byte = tl.load(base_ptr + r + d // 2, mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((d % 2) * 4)) & 0xF
        val = tl.load(levels_ptr + nib, mask=mask, other=0.0)
        x = val * load_fp16_bytes(base_ptr + r + HEAD_BYTES + 2 * (d // GROUP), mask)
    else:
        byte = tl.load(base_ptr + r + d, mask=mask, other=0)
        if QUANT == 1:
            val = byte.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            val = fp8_decode(byte.to(tl.int32))
        scale = load_fp16_bytes(base_ptr + row + HEAD_BYTES, row_mask)  # [N]
        x = val * scale[:, None]
    return x
