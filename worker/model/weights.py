"""Weight formats of the linear layers and the embedding: fp32, bf16 and GGUF's Q8_0 / Q4_0 / Q4_1.

A quantized weight W [N, K] is held row-major as `QuantRows`: `q` [N, K] int8 codes, one fp16
scale `d` per row and block of 32 columns, and for the 4-bit formats one fp16 offset `m` per
block, so that W[n, k] = d[n, k // 32] * q[n, k] (+ m[n, k // 32]) in fp32, exactly as GGUF
dequantizes it. Q4_0's (q - 8) * d is kept as q * d + m with m = -8 d (exact in fp16 and fp32),
so both 4-bit formats run the same kernel. Rows can be concatenated and reordered (the fused
qkv and the interleaved gate/up weights) before `pack` lays them out for the native kernel.

Packed layout (`PackedWeight.data`, uint8 [P, K / 32, B], P = ceil(N / 16) panels of 16 rows):
one record of B bytes per panel and block of 32 columns, read by csrc/qlinear.inc in order:
  Q8_0: d [16] fp16, then q + 128 [8 quads][16 rows][4 k] uint8      B = 32 + 512 = 544
  Q4_*: d [16] fp16, m [16] fp16, then [4 quads][16 rows][4 k] bytes,
        low nibble column 4c + i, high nibble column 16 + 4c + i     B = 64 + 256 = 320
  BF16: w [32 k][16 rows] bf16                                       B = 1024
The codes of 4 consecutive columns of a row sit in one 32-bit lane, 16 rows in 64 bytes: the
lanes of one integer dot-product instruction (vpdpbusd: unsigned codes x signed activation
codes, hence Q8_0's + 128, which the kernel takes off per block).
Rows past N are zero. The bytes per weight equal GGUF's (8.5, 5 and 16 bits).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

BLOCK = 32   # columns per quantization block (GGUF's QK8_0 / QK4_0 / QK4_1)
PANEL = 16   # output rows per panel (csrc/linear.cpp's kPanel)


class WeightFormat(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"

    @property
    def quantized(self) -> bool:
        return self in (WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1)

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight as the kernel holds and reads them (Q4_0 in Q4_1's record: 5)."""
        return 32.0 if self is WeightFormat.FP32 else self.record_bytes * 8 / (BLOCK * PANEL)

    @property
    def kernel_code(self) -> int:
        """The format number csrc/qlinear.cpp takes (0 Q8, 1 Q4 with d and m, 2 BF16)."""
        return {"q8_0": 0, "q4_0": 1, "q4_1": 1, "bf16": 2}[self.value]

    @property
    def record_bytes(self) -> int:
        """Bytes per panel (16 rows) and block (32 columns) in the packed layout."""
        return {"q8_0": 544, "q4_0": 320, "q4_1": 320, "bf16": 1024, "fp32": 2048}[self.value]


WEIGHT_DTYPES = ("auto", *(f.value for f in WeightFormat))


@dataclass(frozen=True, slots=True)
class QuantRows:
    """W [N, K] as codes `q` [N, K] int8, scales `d` [N, K / 32] fp16 and (4-bit) offsets `m`."""

    fmt: WeightFormat
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def __post_init__(self) -> None:
        assert self.fmt.quantized and self.q.dtype == torch.int8 and self.d.dtype == torch.float16
        n, k = self.q.shape
        assert k % BLOCK == 0 and self.d.shape == (n, k // BLOCK), (self.q.shape, self.d.shape)
        assert (self.m is not None) == (self.fmt is not WeightFormat.Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: d * q (+ m), GGUF's own arithmetic (the kernels' reference)."""
        n, k = self.shape
        w = self.q.view(n, k // BLOCK, BLOCK).float() * self.d.float()[:, :, None]
        if self.m is not None:
            w = w + self.m.float()[:, :, None]
        return w.view(n, k)

    def take_rows(self, rows: torch.Tensor) -> QuantRows:
        return QuantRows(self.fmt, self.q[rows], self.d[rows], None if self.m is None else self.m[rows])

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        fmt = parts[0].fmt
        assert all(p.fmt is fmt for p in parts), [p.fmt for p in parts]
        m = None if fmt is WeightFormat.Q8_0 else torch.cat([p.m for p in parts if p.m is not None])
        return QuantRows(fmt, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


@dataclass(frozen=True, slots=True)
class Bf16Weight:
    """W [N, K] stored as bf16 and computed with fp32 activations (a plain bf16 tensor in the
    weights instead means the whole model runs in bf16, `EngineConfig.dtype`)."""

    t: torch.Tensor

    def __post_init__(self) -> None:
        assert self.t.dtype == torch.bfloat16 and self.t.dim() == 2


# a dense tensor (in the activations' dtype), quantized rows, or bf16-stored rows
Weight = torch.Tensor | QuantRows | Bf16Weight


def weight_shape(w: Weight) -> tuple[int, ...]:
    if isinstance(w, QuantRows):
        return w.shape
    return tuple((w.t if isinstance(w, Bf16Weight) else w).shape)


def cat_rows(parts: list[Weight]) -> Weight:
    if all(isinstance(p, QuantRows) for p in parts):
        return QuantRows.cat([p for p in parts if isinstance(p, QuantRows)])
    if all(isinstance(p, Bf16Weight) for p in parts):
        return Bf16Weight(torch.cat([p.t for p in parts if isinstance(p, Bf16Weight)]))
    return torch.cat([dense(p) for p in parts])


def take_rows(w: Weight, rows: torch.Tensor) -> Weight:
    if isinstance(w, QuantRows):
        return w.take_rows(rows)
    return Bf16Weight(w.t[rows]) if isinstance(w, Bf16Weight) else w[rows]


def dense(w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's values as a dense tensor of `dtype` (quantized rows dequantized)."""
    t = w.dequantize() if isinstance(w, QuantRows) else w.t if isinstance(w, Bf16Weight) else w
    return t if t.dtype == dtype else t.to(dtype)


def format_of(w: Weight) -> WeightFormat:
    if isinstance(w, QuantRows):
        return w.fmt
    return WeightFormat.BF16 if isinstance(w, Bf16Weight) or w.dtype == torch.bfloat16 else WeightFormat.FP32


def weight_bytes(w: Weight) -> int:
    """Bytes the weight occupies in its format (what one full read of it streams)."""
    n, k = weight_shape(w)
    return int(n * k * format_of(w).bits_per_weight) // 8


# --- quantizing fp32 rows (ggml's reference quantizers, per block of 32) --------------------------

def quantize(w: torch.Tensor, fmt: WeightFormat) -> QuantRows:
    """fp32 W [N, K] (K a multiple of 32) -> `fmt` as ggml's quantize_row_*_ref does it."""
    assert fmt.quantized
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"{fmt.value} needs the input size to be a multiple of {BLOCK}, not {k}")
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt is WeightFormat.Q8_0:
        d = x.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _round_away(x * inv[..., None]).clamp(-127, 127)
        return QuantRows(fmt, q.to(torch.int8).reshape(n, k), d.half(), None)
    if fmt is WeightFormat.Q4_0:
        idx = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, idx).squeeze(-1) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc(x * inv[..., None] + 8.5), max=15)
        dh = d.half()
        return QuantRows(fmt, q.to(torch.int8).reshape(n, k), dh, dh * -8)
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((x - lo[..., None]) * inv[..., None] + 0.5), max=15)
    return QuantRows(fmt, q.to(torch.int8).reshape(n, k), d.half(), lo.half())


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)   # C's roundf


# --- GGUF blocks ---------------------------------------------------------------------------------

def from_gguf_blocks(fmt: WeightFormat, raw: torch.Tensor, k: int) -> QuantRows:
    """GGUF tensor bytes uint8 [N, K / 32 * block bytes] -> QuantRows (Q8_0, Q4_0, Q4_1)."""
    n = raw.shape[0]
    nb = k // BLOCK
    if fmt is WeightFormat.Q8_0:
        blocks = raw.reshape(n, nb, 34)
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, nb)
        return QuantRows(fmt, blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d.clone(), None)
    head = 2 if fmt is WeightFormat.Q4_0 else 4
    blocks = raw.reshape(n, nb, head + 16)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, nb).clone()
    qs = blocks[..., head:]                                               # [N, nb, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8).reshape(n, k)   # elements j, j + 16
    m = d * -8 if fmt is WeightFormat.Q4_0 else blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, nb).clone()
    return QuantRows(fmt, q, d, m)


# --- the kernel's panel layout -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight in the native kernel's panel layout (see the module docstring); `n`, `k`: W's shape."""

    fmt: WeightFormat
    data: torch.Tensor   # uint8 [P, K / 32, record_bytes]
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack(w: Weight, fmt: WeightFormat, out: torch.Tensor | None = None) -> PackedWeight:
    """W in `fmt` (bf16 or quantized rows) -> the panel layout; into `out` (uint8, P * K / 32 *
    record_bytes elements, e.g. huge-page memory from the native module) when given."""
    n, k = weight_shape(w)
    p, nb = -(-n // PANEL), k // BLOCK
    size = (p, nb, fmt.record_bytes)
    data = torch.empty(size, dtype=torch.uint8) if out is None else out.view(size)
    pad = p * PANEL - n
    if fmt is WeightFormat.BF16:
        t = w.t if isinstance(w, Bf16Weight) else dense(w, torch.bfloat16)
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))                          # [P*16, K]
        t = t.view(p, PANEL, nb, BLOCK).permute(0, 2, 3, 1)                    # [P, nb, 32, 16]
        data.view(p, nb, BLOCK * PANEL * 2).copy_(t.contiguous().view(torch.uint8).view(p, nb, -1))
        return PackedWeight(fmt, data, n, k)
    assert isinstance(w, QuantRows) and w.fmt.kernel_code == fmt.kernel_code
    q = torch.nn.functional.pad(w.q, (0, 0, 0, pad)).view(p, PANEL, nb, BLOCK // 4, 4)   # [P, 16, nb, 8, 4]
    d = torch.nn.functional.pad(w.d, (0, 0, 0, pad)).view(p, PANEL, nb).transpose(1, 2)   # [P, nb, 16]
    data[..., :32].copy_(d.contiguous().view(torch.uint8).view(p, nb, 32))
    if fmt is WeightFormat.Q8_0:
        codes = (q.to(torch.int16) + 128).to(torch.uint8)                            # q + 128
        data[..., 32:].copy_(codes.permute(0, 2, 3, 1, 4).reshape(p, nb, -1))
        return PackedWeight(fmt, data, n, k)
    assert w.m is not None
    m = torch.nn.functional.pad(w.m, (0, 0, 0, pad)).view(p, PANEL, nb).transpose(1, 2)
    data[..., 32:64].copy_(m.contiguous().view(torch.uint8).view(p, nb, 32))
    qk = q.permute(0, 2, 3, 1, 4).to(torch.uint8)                                  # [P, nb, 8, 16, 4]
    data[..., 64:].copy_((qk[:, :, :4] | (qk[:, :, 4:] << 4)).reshape(p, nb, -1))
    return PackedWeight(fmt, data, n, k)
