"""Compile the Triton kernels ahead of time for a GPU architecture, without a GPU: the LLVM
and ptxas that ship in the triton wheel turn each kernel variant into a cubin, and
`ptxas -v` reports its registers and spills. `scripts/gpu-check` runs it (on a CPU machine
too, in its dry run), so a kernel that does not compile, or spills, shows before any GPU
time is spent.

    TRITON_INTERPRET=0 python -m worker.kernels.triton_compile [--arch 90] [--json PATH]

Kernels must be defined compiled (TRITON_INTERPRET unset or 0 when this module is first
imported); the variants cover every QUANT path, fp32 and bf16 queries, and the tile sizes
and warp counts the launches use.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile

from worker.kernels import triton_decode, triton_kv_write, triton_prefill


class Variant(NamedTuple):
    name: str
    kernel: Any  # a triton JITFunction
    types: dict[str, str]  # runtime argument -> Triton type ("*bf16", "i64", "fp32", ...)
    constexprs: dict[str, Any]
    num_warps: int


_STRIDES = ("stride_kb", "stride_kt", "stride_kh", "stride_bt")
_CACHE = {0: ("*bf16", 0, 128), 1: ("*u8", 128, 128), 2: ("*u8", 128, 128), 3: ("*u8", 64, 16)}  # head_dim 128


def variants() -> list[Variant]:
    """Every QUANT path of every kernel at head_dim 128, GQA 4, block 16."""
    out = []
    for quant, (cache, head_bytes, group) in _CACHE.items():
        for q in ("*bf16", "*fp32"):
            types = dict(q_ptr=q, k_ptr=cache, v_ptr=cache, bt_ptr="*i64", lens_ptr="*i64", levels_ptr="*fp32",
                         part_out_ptr="*fp32", part_lse_ptr="*fp32", logits_ptr="*fp32", scale="fp32", window="i32",
                         split_tokens="i32", num_splits="i32", logits_len="i32", stride_qb="i64", stride_qh="i64")
            types |= {s: "i64" for s in _STRIDES}
            out.append(Variant(f"decode-q{quant}-{q[1:]}", triton_decode._decode_split_kernel, types,
                               dict(G=4, G_PAD=16, D=128, D_PAD=128, BLOCK_N=triton_decode.BLOCK_N, BLOCK_SIZE=16,
                                    QUANT=quant, HEAD_BYTES=head_bytes, GROUP=group, STORE_LOGITS=quant == 1,
                                    DOT_F32=q == "*fp32"), 4 if quant == 0 else 8))
        types = dict(q_ptr="*bf16", k_ptr=cache, v_ptr=cache, o_ptr="*bf16", bt_ptr="*i64", lens_ptr="*i64",
                     qsl_ptr="*i64", levels_ptr="*fp32", scale="fp32", window="i32", stride_qt="i64", stride_qh="i64",
                     stride_ot="i64", stride_oh="i64")
        types |= {s: "i64" for s in _STRIDES}
        out.append(Variant(f"prefill-q{quant}-bf16", triton_prefill._prefill_kernel, types,
                           dict(G=4, D=128, D_PAD=128, BLOCK_M=64, BLOCK_N=32, BLOCK_SIZE=16, QUANT=quant,
                                HEAD_BYTES=head_bytes, GROUP=group, DOT_F32=False), 8))
        src = "*fp32" if quant else "*bf16"
        types = dict(key_ptr=src, value_ptr=src, k_ptr=cache, v_ptr=cache, slot_ptr="*i64", mid_ptr="*fp32",
                     stride_kt="i64", stride_kh="i64", stride_vt="i64", stride_vh="i64", stride_cb="i64",
                     stride_ct="i64", stride_ch="i64")
        out.append(Variant(f"kv-write-q{quant}", triton_kv_write._kv_write_kernel, types,
                           dict(BLOCK_SIZE=16, D=128, D_PAD=128, QUANT=quant, HEAD_BYTES=head_bytes, GROUP=group,
                                NG_PAD=8 if quant == 3 else 1), 4))
    types = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", num_splits="i32",
                 stride_ob="i64", stride_oh="i64")
    out.append(Variant("decode-reduce", triton_decode._decode_reduce_kernel, types, dict(D=128, D_PAD=128, S_PAD=8), 4))
    return out


def _ptxas() -> str | None:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(bundled) if bundled.exists() else shutil.which("ptxas")


def compile_variant(v: Variant, arch: int) -> dict[str, Any]:
    """Compile one variant to a cubin for sm_`arch`; its registers, spill bytes, shared memory."""
    sig = {name: v.types.get(name, "constexpr") for name in v.kernel.arg_names}
    consts = {(v.kernel.arg_names.index(k),): value for k, value in v.constexprs.items()}
    t = time.perf_counter()
    compiled = triton_compile(ASTSource(fn=v.kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": v.num_warps})
    row: dict[str, Any] = {"name": v.name, "num_warps": v.num_warps, "compile_s": round(time.perf_counter() - t, 1),
                           "shared_bytes": compiled.metadata.shared}
    ptxas = _ptxas()
    if ptxas is not None:
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                                str(ptx), "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
        text = r.stdout + r.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores", text)
        row |= {"registers": int(regs.group(1)) if regs else None,
                "spill_bytes": int(spills.group(1)) if spills else None}
    return row


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m worker.kernels.triton_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args()
    rows = []
    for v in variants():
        try:
            row = compile_variant(v, args.arch)
        except Exception as e:  # a variant that does not compile is the finding; report it and go on
            row = {"name": v.name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
