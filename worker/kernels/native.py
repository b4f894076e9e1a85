"""Native CPU kernels (C++, `csrc/`), built on first use and cached per machine.

`packed_linear` is y = x Wᵀ (+ b) (+ residual) for few rows (decode) over a weight packed once
by `pack_linear` into a layout the kernel streams near the read bandwidth (see csrc/linear.cpp);
`worker.model.linear.Linear` uses it and keeps F.linear for many rows and as the fallback.
`paged_decode` is decode attention read in place from an fp32 paged cache: the torch path
(`worker.kernels.decode`) gathers every block a step reads into a dense copy and reads it
again in SDPA, which makes decode attention memory-bound on CPU; the kernel reads each
cached byte once; `rope_paged_decode` is the same attention with the layer's RoPE and KV write
before it, one call per layer of a decode step (what `worker.kernels.backend`'s native ops offer
the model as `rope_decode`). Everything they do not cover (GPU, other dtypes, quantized caches, score
collection for H2O) stays on the torch path, which is also the oracle it is tested against.

Built with `torch.utils.cpp_extension` (a C++ compiler and ninja; ~30-40 s once) into
`<kernels dir>/<key>`, where the key covers the source, torch, Python, the platform and the
flags; later processes import the built module directly. The kernels dir is
`$KVMESH_KERNELS_DIR`, else `cache_root()/kernels`. `make setup` builds it; the CPU image
builds it at image build time into a directory of the image.
When it cannot be built the engine logs one warning and runs the torch path;
`KVMESH_NATIVE_KERNELS=0` turns the kernels off.

    python -m worker.kernels.native      # build now (exits 1 if it cannot)
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from kvstore.quant import KVCache, QuantizedKV

log = logging.getLogger(__name__)

NAME = "kvmesh_native"
SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("paged_decode.cpp", "linear.cpp", "qlinear.cpp", "block_copy.cpp", "block_hash.cpp"))
INCLUDES = (Path(__file__).parent / "csrc" / "qlinear.inc",)   # in the build key, not compiled alone
ENV_SWITCH = "KVMESH_NATIVE_KERNELS"
ENV_DIR = "KVMESH_KERNELS_DIR"


def _flags() -> list[str]:
    # at::parallel_for is OpenMP in torch's CPU builds (torch's libgomp at run time); no implicit FMA
    # contraction, so a * b + c * d is rounded as torch rounds it (RoPE matches torch bit for bit;
    # the kernels' FMAs are explicit intrinsics)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def build_dir() -> Path:
    from worker.model.loader import cache_root

    h = hashlib.sha256()
    for src in SOURCES + INCLUDES:
        h.update(src.read_bytes())
    h.update(repr((torch.__version__, sys.version, platform.machine(), platform.system(), _flags())).encode())
    root = Path(os.environ[ENV_DIR]).expanduser() if os.environ.get(ENV_DIR) else cache_root() / "kernels"
    return root / f"{NAME}-{h.hexdigest()[:16]}"


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> ModuleType:
    """Build (or find) the extension and import it; raises when it cannot be built."""
    d = build_dir()
    ready = d / "ready"
    if ready.exists():
        return _import(Path(ready.read_text()))
    from torch.utils import cpp_extension

    d.mkdir(parents=True, exist_ok=True)
    log.info("building native CPU kernels in %s (once per machine)", d)
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the `ninja` wheel (a dependency) puts it beside the interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        # cpp_extension locks the build dir, so concurrent first starts build it once
        module = cpp_extension.load(NAME, [str(s) for s in SOURCES], extra_cflags=_flags(),
                                    extra_ldflags=["-fopenmp"], build_directory=str(d), verbose=False)
    finally:
        os.environ["PATH"] = path
    tmp = d / f"ready.{os.getpid()}"
    tmp.write_text(str(Path(module.__file__).resolve()))
    tmp.replace(ready)
    return module


@functools.cache
def load() -> ModuleType | None:
    """The built module, or None (switched off, or it cannot be built: warned once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        return build()
    except Exception as e:  # no compiler, no ninja, a read-only cache dir, ...
        log.warning("native CPU kernels unavailable, decode attention and the linear layers run on the "
                    "torch path: %s", e)
        return None


def decode_supported(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache) -> bool:
    """Whether `paged_decode` takes these tensors (and the kernel is built)."""
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        return False
    module = load()
    return (module is not None and query.device.type == "cpu"
            and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and query.shape[1] // k_cache.shape[2] <= module.max_group)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence) over the first `seq_lens[b]` cached tokens
    (the last `sliding_window` of them) of block table row b -> [B, Hq, D]. Check
    `decode_supported` first."""
    module = load()
    assert module is not None, "paged_decode: the native kernels are not built"
    return module.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0)


def rope_decode_supported(qkv: torch.Tensor, k_cache: KVCache, v_cache: KVCache, num_heads: int) -> bool:
    """Whether `rope_paged_decode` takes these tensors (and the kernel is built)."""
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        return False
    module = load()
    return (module is not None and qkv.device.type == "cpu"
            and qkv.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and num_heads // k_cache.shape[2] <= module.max_group)


def rope_paged_decode(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, sliding_window: int | None, num_heads: int) -> torch.Tensor:
    """A decode step's attention for one layer in one call: qkv [B, (Hq + 2 Hkv) D], each token's
    q | k | v before RoPE (one token per sequence); cos, sin_signed [B, 1, D] (`worker.model.llama.
    Rotary.tables`). RoPE of q and k (bit for bit `Rotary.apply`), k and v written at
    `slot_mapping` [B] (as `reference.write_kv`), then `paged_decode` of the rotated queries ->
    [B, Hq * D]. Check `rope_decode_supported` first."""
    module = load()
    assert module is not None, "rope_paged_decode: the native kernels are not built"
    return module.rope_paged_decode(qkv, cos, sin_signed, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                    scale, sliding_window or 0, num_heads)


def block_copier() -> Callable[..., None] | None:
    """The native `copy_blocks` for `kvstore.tiers.HostTier` (KV blocks between the pool and the
    host tier as one parallel loop of memcpys), or None when the kernels are not built."""
    module = load()
    return None if module is None else module.copy_blocks


def checksum_kernel() -> ModuleType | None:
    """The native per-block XXH3 checksums for `kvstore.transfer.wire.BlockHashers` (its
    `xxh3_blocks_*`, bit-equal to the python path, one call per piece with the GIL released),
    or None when the kernels are not built. A module-level function: the bench hands it to a
    spawned process."""
    return load()


def linear_supported(weight: torch.Tensor) -> bool:
    """Whether `pack_linear` / `packed_linear` take this weight: 2-d fp32 on CPU, and the kernel
    built with AVX2 + FMA (its plain C++ loops are slower than torch's GEMM, so without them the
    torch path runs)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    module = load()
    return module is not None and bool(module.linear_vectorized)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> packed [ceil(N / 16), K, 16] for `packed_linear` (a copy; check
    `linear_supported` first)."""
    module = load()
    assert module is not None, "pack_linear: the native kernels are not built"
    return module.pack_linear(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, gated: bool = False) -> torch.Tensor:
    """x [M, K] against `pack_linear(W)` of a W with n rows -> [M, n] = residual + (x Wᵀ + bias).

    `norm_weight` [K]: x is RMS-normalised first (`worker.model.linear.rms_norm`'s arithmetic, `eps`).
    `gated`: W's rows are interleaved 8 gate rows, 8 up rows (`worker.model.linear.GatedLinear`) and
    the result is silu(gate) * up, [M, n // 2]."""
    module = load()
    assert module is not None, "packed_linear: the native kernels are not built"
    return module.packed_linear(x, packed, n, bias, residual, norm_weight, eps, gated)


def qlinear_isa() -> str:
    """The instruction set `qlinear` runs here ("avx512", "avx2"), or "" when it cannot run (no
    AVX2 + FMA + F16C, or the kernels are not built): quantized and bf16 weights are then
    dequantized to fp32 at load."""
    module = load()
    return "" if module is None else str(module.qlinear_isa())


def empty_huge_bytes(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on 2 MiB-aligned memory advised for transparent huge pages."""
    module = load()
    assert module is not None, "empty_huge_bytes: the native kernels are not built"
    return module.empty_huge_bytes(nbytes)


def qlinear(x: torch.Tensor, packed: torch.Tensor, fmt: int, n: int, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 1e-6, gated: bool = False) -> torch.Tensor:
    """x [M, K] (any M) against a weight packed by `worker.model.weights.pack` (format code `fmt`:
    0 Q8_0, 1 Q4_0 / Q4_1, 2 bf16) with n rows -> [M, n] = residual + (x Wᵀ + bias); the other
    arguments as `packed_linear`. Check `qlinear_isa` first."""
    module = load()
    assert module is not None, "qlinear: the native kernels are not built"
    return module.qlinear(x, packed, fmt, n, bias, residual, norm_weight, eps, gated)


def qrows(packed: torch.Tensor, fmt: int, n: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of a packed weight with n rows, dequantized -> fp32 [T, K] (the embedding)."""
    module = load()
    assert module is not None, "qrows: the native kernels are not built"
    return module.qrows(packed, fmt, n, ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x²) + eps)) row by row, x [M, K] fp32 on CPU (one pass; rows
    over the threads from 64 rows up). Check `linear_supported` first."""
    module = load()
    assert module is not None, "rms_norm: the native kernels are not built"
    return module.rms_norm(x, weight, eps)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """[gate | up] [M, 2 I] fp32 on CPU -> silu(gate) * up [M, I], in one pass."""
    module = load()
    assert module is not None, "silu_mul: the native kernels are not built"
    return module.silu_mul(y)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"native CPU kernels: {build().__file__}")
    except Exception as e:
        print(f"native CPU kernels cannot be built: {e}", file=sys.stderr)
        sys.exit(1)
