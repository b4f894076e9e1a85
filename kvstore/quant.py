"""Quantized KV codecs: int8, int4 (two values per byte) and fp8 e4m3, scaled per (token, head)
(int4: per group of 16 values of a head vector).

One K or V head vector of one token (`head_dim` values) is stored as a *slot*: its packed
values followed by its fp16 metadata, `KVLayout.head_bytes + KVLayout.head_meta_bytes` bytes:

| dtype | values                                        | metadata (fp16)               | decode            |
|-------|-----------------------------------------------|-------------------------------|-------------------|
| int8  | round(x / scale) in [-127, 127], 1 byte each  | scale = absmax / 127          | q * scale         |
| int4  | nearest of `INT4_LEVELS` to x / scale, 2/byte | per 16 values: scale = absmax | LEVELS[q] * scale |
| fp8   | x / scale as float8_e4m3fn, 1 byte each       | scale = absmax / 448          | f8 * scale        |

fp8 and int4 first rotate each head vector by `R`, a normalised Sylvester Hadamard matrix
(block-diagonal with blocks of the largest power of two dividing head_dim; orthogonal,
symmetric, R @ R = I), and quantize `x @ R`. The rotation spreads a few large channels over
all of them, so one per-vector scale fits every element better; it costs no bytes. Measured
on SmolLM2-135M (`kvmesh bench accuracy --quick`), it takes the fp8 perplexity delta from
1.6% to about 0.2%; int8 gains nothing and is not rotated.

int4 levels: after the rotation the values of a head vector are close to Gaussian, so int4
does not use 16 evenly spaced levels but the 16 that minimise the squared error of a
Gaussian group of 16 divided by its absolute maximum (Lloyd-Max, with ±1 kept as levels so
the largest value of every group is stored exactly, and 0 so that zeros — a rotated constant
vector is mostly zeros — stay zeros: 7 levels below 0, 8 above; `INT4_LEVELS`, checked by
`tests/kvstore/test_quant.py::test_int4_levels_are_lloyd_max`), in the spirit of QLoRA's
NF4. One fp16 scale per 16 values costs the same bytes as the scale + zero point per 32
values it replaced.

int4 packs element 2i in the low nibble and 2i+1 in the high nibble of byte i. Scales are
rounded to fp16 BEFORE the values are quantized, so encode and decode use the same scale.
Rounding is to nearest (ties to even; int4: to the nearest level). A head vector of zeros
(or one so small its scale underflows fp16) gets scale 0 and decodes to zeros — never NaN;
an all-zero slot (a fresh pool) decodes to zeros.

Worst-case error per element of the (rotated) vector that was quantized — what the tests
check: int8 ≤ scale / 2; int4 ≤ scale × (the largest gap between adjacent levels) / 2;
fp8 ≤ |y| / 16 + scale · 2^-10 (3 mantissa bits; subnormals below 2^-6).
R is orthogonal, so the error vector of `x` has the same L2 norm.

Keys can also be scaled per channel before they are quantized (`KVCacheScales`, see
`worker.model.calibration`): the quantization error of a key matters through q·k, so channels
where queries are large get finer steps. That scaling is done by the model, not here.

`QuantizedKV` is what a paged cache of one layer's K (or V) looks like when quantized: the
slot bytes `[num_blocks, block_size, num_kv_heads, slot_bytes]` (uint8) and the codec. The
attention kernels take it where they take a plain `[num_blocks, block_size, H, D]` tensor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstore.layout import KVLayout, KVQuant, int4_group_size

_FP16_MAX = 65504.0
_INT8_MAX = 127.0
# Lloyd-Max levels for a Gaussian group of 16 divided by its absolute maximum, -1, 0, 1 fixed
INT4_LEVELS = (-1.0, -0.8002, -0.6335, -0.4878, -0.3557, -0.2326, -0.1149, 0.0,
               0.1007, 0.2030, 0.3087, 0.4201, 0.5404, 0.6730, 0.8235, 1.0)
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Encoded(NamedTuple):
    """Quantized head vectors: `data` [..., head_bytes] uint8, `meta` [..., 1 | 2] fp16."""

    data: torch.Tensor
    meta: torch.Tensor


@dataclass(frozen=True, slots=True)
class KVCodec:
    """Quantize / dequantize head vectors of `head_dim` values for one quantized KV dtype."""

    quant: KVQuant
    head_dim: int

    def __post_init__(self) -> None:
        if self.quant is KVQuant.NONE:
            raise ValueError("quant=KVQuant.NONE has no codec; plain dtypes are stored as they are")
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive integer")
        if self.quant is KVQuant.INT4 and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for int4 (two values per byte)")

    @classmethod
    def for_layout(cls, layout: KVLayout) -> KVCodec:
        """The codec of a quantized layout; its byte counts equal the layout's (asserted)."""
        codec = cls(layout.quant, layout.head_dim)
        assert (codec.head_bytes, codec.meta_bytes) == (layout.head_bytes, layout.head_meta_bytes), layout
        return codec

    @property
    def rotates(self) -> bool:
        """True when values are quantized in the Hadamard-rotated basis (fp8, int4)."""
        return self.quant is not KVQuant.INT8

    def rotation(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """`R` [head_dim, head_dim] (symmetric, R @ R = I), or None when values are not rotated.

        A kernel that reads `decode(..., rotated=True)` values computes attention with `q @ R`
        and multiplies its output by `R`.
        """
        return _hadamard(self.head_dim, device, dtype) if self.rotates else None

    @property
    def head_bytes(self) -> int:
        """Packed value bytes of one head vector."""
        return self.head_dim // 2 if self.quant is KVQuant.INT4 else self.head_dim

    @property
    def group_size(self) -> int:
        """Values sharing one scale: int4 groups (see `kvstore.layout.int4_group_size`), else all."""
        return int4_group_size(self.head_dim) if self.quant is KVQuant.INT4 else self.head_dim

    @property
    def meta_len(self) -> int:
        """fp16 metadata values per head vector: one scale (int8, fp8) or one per group (int4)."""
        return self.head_dim // self.group_size

    @property
    def meta_bytes(self) -> int:
        return 2 * self.meta_len

    @property
    def slot_bytes(self) -> int:
        """Bytes of one stored head vector: values then metadata."""
        return self.head_bytes + self.meta_bytes

    # -- values + metadata ----------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Encoded:
        """Quantize `x` [..., head_dim] (any float dtype), each head vector on its own scale."""
        assert x.shape[-1] == self.head_dim, (x.shape, self.head_dim)
        xf = x.float()
        if self.rotates:
            xf = xf @ _hadamard(self.head_dim, xf.device, torch.float32)
        if self.quant is KVQuant.INT4:
            g = xf.unflatten(-1, (-1, self.group_size))  # [..., D/G, G]
            scale = _fp16(g.abs().amax(-1, keepdim=True))  # [..., D/G, 1]
            s = scale.float()
            u = (g / torch.where(s > 0, s, 1.0)).flatten(-2)  # [..., D] in [-1, 1]
            q = torch.bucketize(u, _int4_midpoints(u.device)).to(torch.uint8)  # nearest level
            data = q[..., 0::2] | (q[..., 1::2] << 4)  # [..., D/2] low nibble first
            return Encoded(data, scale.flatten(-2))  # [..., D/G]
        absmax = xf.abs().amax(-1, keepdim=True)  # [..., 1]
        if self.quant is KVQuant.INT8:
            scale = _fp16(absmax / _INT8_MAX)
            s = scale.float()
            q = (xf / torch.where(s > 0, s, 1.0)).round_().clamp_(-_INT8_MAX, _INT8_MAX)
            return Encoded(q.to(torch.int8).view(torch.uint8), scale)
        scale = _fp16(absmax / _FP8_MAX)  # FP8
        s = scale.float()
        y = (xf / torch.where(s > 0, s, 1.0)).clamp_(-_FP8_MAX, _FP8_MAX)
        return Encoded(y.to(torch.float8_e4m3fn).view(torch.uint8), scale)

    def decode(self, data: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype,
               rotated: bool = False) -> torch.Tensor:
        """Head vectors [..., head_dim] in `dtype` from `data` [..., head_bytes] and `meta`.

        `rotated=True` leaves them in the rotated basis (`x @ R`; the same as False when the
        codec does not rotate). Arithmetic runs in fp16 for fp16 and in fp32 otherwise (bf16
        would round the scale).
        """
        compute = torch.promote_types(dtype, torch.float16)
        scale = meta[..., :1].to(compute)  # [..., 1]
        if self.quant is KVQuant.INT8:
            out = data.view(torch.int8).to(compute) * scale
        elif self.quant is KVQuant.FP8:
            out = data.view(torch.float8_e4m3fn).to(compute) * scale
        else:  # INT4
            q = torch.stack((data & 0xF, data >> 4), -1).flatten(-2)  # [..., D]
            levels = _int4_levels(data.device, compute)[q.long()]  # [..., D]
            out = (levels.unflatten(-1, (-1, self.group_size))
                   * meta.to(compute).unsqueeze(-1)).flatten(-2)  # [..., D]
        if self.rotates and not rotated:
            out = out @ _hadamard(self.head_dim, out.device, compute)
        return out if compute == dtype else out.to(dtype)

    # -- slots: values and metadata in one byte row ----------------------------------------
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., head_dim] -> slots [..., slot_bytes] uint8 (values, then fp16 metadata)."""
        enc = self.encode(x)
        return torch.cat((enc.data, enc.meta.contiguous().view(torch.uint8)), -1)

    def split(self, slots: torch.Tensor) -> Encoded:
        """Slots [..., slot_bytes] -> values (a view) and metadata (a small fp16 copy)."""
        assert slots.dtype == torch.uint8 and slots.shape[-1] == self.slot_bytes, (slots.dtype, slots.shape)
        # the copy makes the fp16 view legal whatever the slot width's parity
        return Encoded(slots[..., :self.head_bytes], slots[..., self.head_bytes:].contiguous().view(torch.float16))

    def dequantize(self, slots: torch.Tensor, dtype: torch.dtype, rotated: bool = False) -> torch.Tensor:
        """Slots [..., slot_bytes] uint8 -> head vectors [..., head_dim] in `dtype` (see `decode`)."""
        enc = self.split(slots)
        return self.decode(enc.data, enc.meta, dtype, rotated)


@functools.lru_cache(maxsize=64)
def _hadamard(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Block-diagonal normalised Sylvester Hadamard [dim, dim]: blocks of the largest power of
    two dividing `dim` (1 = identity for odd dims). Exact ±1/sqrt(b) entries: the same on
    every machine, so blocks quantized on one worker decode on another."""
    block = dim & -dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    full = torch.block_diag(*[h / block ** 0.5] * (dim // block))
    return full.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=16)
def _int4_levels(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(INT4_LEVELS, dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _int4_midpoints(device: torch.device) -> torch.Tensor:
    """The 15 decision boundaries between adjacent `INT4_LEVELS` (fp32)."""
    lv = torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device)
    return (lv[1:] + lv[:-1]) / 2


def _fp16(x: torch.Tensor) -> torch.Tensor:
    # a scale or zero point beyond fp16 would become inf, and inf * 0 = NaN on decode
    return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


class QuantizedKV(NamedTuple):
    """One layer's quantized K (or V) cache: slots `[num_blocks, block_size, H, slot_bytes]`.

    `slots` is a view into the pool's backing tensor (writes land in the pool); `codec`
    turns slots into values. Kernels gather the slots they need and dequantize only those.
    """

    slots: torch.Tensor
    codec: KVCodec

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape `(num_blocks, block_size, num_kv_heads, head_dim)`."""
        num_blocks, block_size, num_kv_heads, _ = self.slots.shape
        return (num_blocks, block_size, num_kv_heads, self.codec.head_dim)

    @property
    def data(self) -> torch.Tensor:
        """The packed values `[num_blocks, block_size, H, head_bytes]` (a view)."""
        return self.slots[..., :self.codec.head_bytes]

    def meta(self) -> torch.Tensor:
        """The fp16 scales `[num_blocks, block_size, H, 1 | groups]` (a copy)."""
        return self.codec.split(self.slots).meta

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole cache dequantized (in the original basis) `[num_blocks, block_size, H, head_dim]`
        (for tests, not kernels)."""
        return self.codec.dequantize(self.slots, dtype)


KVCache = torch.Tensor | QuantizedKV
"""What a kernel takes as one layer's K or V cache."""
