"""KV write in Triton: this step's K/V rows into their cache slots, quantized in the same
kernel for int8, fp8 and int4 (the torch twin is `reference.write_kv`).

One program per (new token, kv head) stores that token's K and V head vectors. A quantized
slot gets the same bytes `KVCodec.quantize` produces: the fp16 scale is rounded before the
values are divided by it, division is IEEE (`tl.div_rn`), int8 rounds half to even, fp8 is
encoded with integer arithmetic (see `triton_common`), int4 picks the nearest level by the
same midpoints. The Hadamard rotation of fp8 / int4 is the reference's own torch matmul,
applied before the launch.

A slot of -1 is skipped: the padded rows of a captured CUDA-graph batch carry it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.quant import KVCache, QuantizedKV
from worker.kernels.triton_common import cache_args, fp8_encode, int4_midpoints, next_pow2, rne


@triton.jit
def _store_fp16_bytes(ptr, value, mask):
    """Store fp16 `value` as two bytes (little-endian) at `ptr`, `ptr + 1`."""
    bits = value.to(tl.uint16, bitcast=True)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _write_one(src_ptr, dst_ptr, mid_ptr, D: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr,
               HEAD_BYTES: tl.constexpr, GROUP: tl.constexpr, NG_PAD: tl.constexpr):
    """One head vector from `src_ptr` (D values) into the slot at `dst_ptr`."""
    if QUANT == 3:
        HALF_PAD: tl.constexpr = D_PAD // 2
        offs_i = tl.arange(0, HALF_PAD)
        im = offs_i < D // 2
        ev = tl.load(src_ptr + 2 * offs_i, mask=im, other=0.0).to(tl.float32)  # elements 2i (low nibbles)
        od = tl.load(src_ptr + 2 * offs_i + 1, mask=im, other=0.0).to(tl.float32)  # elements 2i + 1
        g = tl.arange(0, NG_PAD)
        member = ((2 * offs_i)[None, :] // GROUP == g[:, None]) & im[None, :]  # [NG_PAD, HALF_PAD]
        amax = tl.max(tl.where(member, tl.maximum(tl.abs(ev), tl.abs(od))[None, :], 0.0), axis=1)  # [NG_PAD]
        scale = tl.minimum(amax, 65504.0).to(tl.float16)
        s = tl.sum(tl.where(member, scale.to(tl.float32)[:, None], 0.0), axis=0)  # [HALF_PAD] scale of each pair
        div = tl.where(s > 0, s, 1.0)
        mids = tl.load(mid_ptr + tl.arange(0, 16))  # [16], the last +inf
        qe = tl.sum((mids[None, :] < tl.div_rn(ev, div)[:, None]).to(tl.int32), axis=1)
        qo = tl.sum((mids[None, :] < tl.div_rn(od, div)[:, None]).to(tl.int32), axis=1)
        tl.store(dst_ptr + offs_i, (qe | (qo << 4)).to(tl.uint8), mask=im)
        _store_fp16_bytes(dst_ptr + HEAD_BYTES + 2 * g, scale, g < D // GROUP)
    else:
        offs = tl.arange(0, D_PAD)
        m = offs < D
        x = tl.load(src_ptr + offs, mask=m, other=0.0)
        if QUANT == 0:
            tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=m)
        else:
            x = x.to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
            if QUANT == 1:
                scale = tl.minimum(tl.div_rn(amax, 127.0), 65504.0).to(tl.float16)
            else:
                scale = tl.minimum(tl.div_rn(amax, 448.0), 65504.0).to(tl.float16)
            s = scale.to(tl.float32)
            y = tl.div_rn(x, tl.where(s > 0, s, 1.0))
            if QUANT == 1:
                code = tl.minimum(tl.maximum(rne(y), -127.0), 127.0).to(tl.int32) & 0xFF  # two's complement byte
            else:
                code = fp8_encode(tl.minimum(tl.maximum(y, -448.0), 448.0))
            tl.store(dst_ptr + offs, code.to(tl.uint8), mask=m)
            _store_fp16_bytes(dst_ptr + HEAD_BYTES, scale, True)


@triton.jit
def _kv_write_kernel(key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr, mid_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     BLOCK_SIZE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr,
                     HEAD_BYTES: tl.constexpr, GROUP: tl.constexpr, NG_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch
        _write_one(key_ptr + t * stride_kt + h * stride_kh, k_ptr + dst, mid_ptr,
                   D, D_PAD, QUANT, HEAD_BYTES, GROUP, NG_PAD)
        _write_one(value_ptr + t * stride_vt + h * stride_vh, v_ptr + dst, mid_ptr,
                   D, D_PAD, QUANT, HEAD_BYTES, GROUP, NG_PAD)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V rows `[T, Hkv, D]` at their slots (in place; quantized if the
    cache is). Same contract as `reference.write_kv`; slots of -1 are skipped."""
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert len(k_cache.shape) == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert key.shape[1:] == k_cache.shape[2:], (key.shape, k_cache.shape)
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    kc, vc = cache_args(k_cache), cache_args(v_cache)
    assert kc[1:] == vc[1:], "K and V caches must share quantization and layout"
    if isinstance(k_cache, QuantizedKV):
        rot = k_cache.codec.rotation(key.device, torch.float32)
        if rot is not None:  # the reference's encode: x.float() @ R, then quantize
            key, value = key.float() @ rot, value.float() @ rot
    elif key.dtype != k_cache.dtype:  # cast as the reference does (the interpreter truncates to bf16)
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = key.contiguous() if key.stride(2) != 1 else key, value.contiguous() if value.stride(2) != 1 else value
    d_pad = next_pow2(head_dim, 2)
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        key, value, kc.data, vc.data, slot_mapping, int4_midpoints(key.device),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kc.stride_block, kc.stride_token, kc.stride_head,
        BLOCK_SIZE=k_cache.shape[1], D=head_dim, D_PAD=d_pad, QUANT=int(kc.quant), HEAD_BYTES=kc.head_bytes,
        GROUP=kc.group, NG_PAD=next_pow2(head_dim // kc.group))
