"""The Triton kernels (worker/kernels/triton_*.py) against the torch reference, their oracle.

On a machine without CUDA every kernel runs in the Triton interpreter (TRITON_INTERPRET=1,
set here before any kernel is defined) on CPU tensors; with CUDA (and TRITON_INTERPRET
unset) the same tests compile the kernels and run on the GPU, marked `gpu`
(`scripts/gpu-check` runs them). Shapes are tiny: the interpreter runs every program in
numpy.

Each case fills a whole paged pool with random K/V (so a kernel reading a wrong slot reads
garbage), writes the sequences' K/V through `reference.write_kv` at random non-contiguous
blocks, and compares the Triton result with `reference.paged_attention` (torch path) on the
same cache: bit-equal bytes for KV writes, dtype tolerances for attention.
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is installed by `make setup` (Linux only)")

from kvstore.layout import KVLayout  # noqa: E402
from kvstore.quant import KVCache  # noqa: E402
from kvstore.tensors import KVTensors  # noqa: E402
from worker.kernels import reference, triton_attention  # noqa: E402
from worker.kernels.reference import AttnMetadata  # noqa: E402
from worker.kernels.triton_decode import BLOCK_N, Splits, decode, plan_splits  # noqa: E402
from worker.kernels.triton_kv_write import write_kv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE = BLOCK_N  # keys per decode tile
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.gpu)
    if not torch.cuda.is_available():
        pytestmark.append(pytest.mark.skip(reason="TRITON_INTERPRET=0 compiles the kernels: needs CUDA"))

QDTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (kv cache dtype, query dtype): every KV dtype, quantized ones under each query precision once
DTYPES = [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp32"), ("int8", "bf16"),
          ("fp8", "fp16"), ("fp8", "fp32"), ("int4", "fp32"), ("int4", "fp16")]
DTYPE_IDS = [f"{kv}-q{q}" for kv, q in DTYPES]


class Case(NamedTuple):
    query: torch.Tensor  # [T, Hq, D]
    k_cache: KVCache
    v_cache: KVCache
    meta: AttnMetadata


def make_case(seqs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int,
              kv_dtype: str, q_dtype: str, seed: int = 0, collect_scores: bool = False) -> Case:
    """`seqs` holds (query_len, seq_len) per sequence; the whole pool holds garbage first."""
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for _, n in seqs]
    num_blocks = sum(needed) + 3
    kv = KVTensors(KVLayout(1, num_kv_heads, head_dim, block_size, kv_dtype), num_blocks, DEVICE)
    k_cache, v_cache = kv.k_caches[0], kv.v_caches[0]
    dtype = QDTYPES[q_dtype]
    all_slots = torch.arange(num_blocks * block_size, device=DEVICE)
    garbage = (5 * torch.randn(2, len(all_slots), num_kv_heads, head_dim, generator=gen)).to(DEVICE, dtype)
    reference.write_kv(garbage[0], garbage[1], k_cache, v_cache, all_slots)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at:at + n])
        at += n
    lens = [n for _, n in seqs]
    fill = AttnMetadata.build(lens, lens, tables, block_size, DEVICE)  # every cached token, prefix and new
    kvs = torch.randn(2, sum(lens), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    reference.write_kv(kvs[0], kvs[1], k_cache, v_cache, fill.slot_mapping)
    meta = AttnMetadata.build([q for q, _ in seqs], lens, tables, block_size, DEVICE, collect_scores=collect_scores)
    query = torch.randn(meta.num_tokens, num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return Case(query, k_cache, v_cache, meta)


def expected(case: Case, window: int | None) -> torch.Tensor:
    return reference.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.query.shape[-1] ** -0.5,
                                     window, allow_native=False)


def check(case: Case, window: int | None = None) -> None:
    out = triton_attention.paged_attention(case.query, case.k_cache, case.v_cache, case.meta,
                                           case.query.shape[-1] ** -0.5, window)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    tol = TOL[case.query.dtype]
    torch.testing.assert_close(out.float(), expected(case, window).float(), atol=tol, rtol=tol)


# -- KV write ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [16, 12, 64])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "int8", "fp8", "int4"])
def test_kv_write_bytes_equal_reference(kv_dtype: str, head_dim: int) -> None:
    """The same slot bytes as `reference.write_kv` (quantized: values and fp16 scales), slot -1
    skipped; a zero head vector, tiny and large values included."""
    layout = KVLayout(1, 2, head_dim, 4, kv_dtype)
    ours, ref = KVTensors(layout, 6, DEVICE), KVTensors(layout, 6, DEVICE)
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(2, 9, 2, head_dim, generator=gen) * torch.logspace(-3, 3, 9)[None, :, None, None]
    x[0, 0, 0] = 0.0
    key, value = x.to(DEVICE, torch.float16 if kv_dtype == "fp16" else torch.float32)
    slots = torch.randperm(24, generator=gen)[:9].to(DEVICE)
    reference.write_kv(key[1:], value[1:], ref.k_caches[0], ref.v_caches[0], slots[1:])
    slots[0] = -1  # a padded row of a captured graph: written nowhere
    write_kv(key, value, ours.k_caches[0], ours.v_caches[0], slots)
    assert torch.equal(ours.kv, ref.kv)


# -- decode -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv_dtype", "q_dtype"), DTYPES, ids=DTYPE_IDS)
def test_decode_every_kv_dtype(kv_dtype: str, q_dtype: str) -> None:
    check(make_case([(1, n) for n in (1, 5, 16, 17, 70)], (9, 3), 16, 4, kv_dtype, q_dtype, seed=3))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3), (4, 1), (32, 2)], ids=["mha", "gqa", "gqa3", "mqa", "g16"])
def test_decode_heads_and_block_sizes(heads: tuple[int, int], block_size: int) -> None:
    check(make_case([(1, n) for n in (3, 33, 48)], heads, 16, block_size, "fp16", "fp16", seed=block_size))


@pytest.mark.parametrize("head_dim", [12, 64])
def test_decode_head_dims(head_dim: int) -> None:
    """A head_dim that is not a power of two is padded and masked in the kernel."""
    check(make_case([(1, 9), (1, 40)], (4, 2), head_dim, 4, "int8", "fp16", seed=head_dim))


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize(("kv_dtype", "q_dtype"), [("fp32", "fp32"), ("int4", "fp16")])
def test_decode_sliding_window(window: int, kv_dtype: str, q_dtype: str) -> None:
    check(make_case([(1, n) for n in (1, 3, 16, 17, 41, 90)], (4, 2), 16, 4, kv_dtype, q_dtype, seed=window), window)


@pytest.mark.parametrize("split_tokens", [TILE, 2 * TILE, 8 * TILE])
def test_decode_split_k_equals_one_split(split_tokens: int) -> None:
    """Batch 1 over a long context: any split of the keys gives the reference's output; splits
    past a sequence's end (as in a captured graph sized for max_model_len) are empty."""
    case = make_case([(1, 250), (1, 7)], (8, 2), 16, 16, "fp32", "fp32", seed=7)
    num_splits = -(-250 // split_tokens) + 2
    out, lse = decode(case.query, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, 0.25,
                      None, Splits(split_tokens, num_splits))
    ref = reference.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, 0.25, allow_native=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(lse).all()


def test_plan_splits_fills_the_gpu_and_covers_the_keys() -> None:
    assert plan_splits(1, 8, 4096, tile=32) == Splits(64, 64)  # batch 1: 8 x 64 programs
    assert plan_splits(1, 8, 4096, tile=64) == Splits(64, 64)
    big = plan_splits(64, 8, 4096, tile=32)
    assert big == Splits(4096, 1)  # 512 programs already
    assert plan_splits(256, 8, 100, tile=32) == Splits(128, 1)  # enough programs: one split
    for tile in (32, 64):
        for batch, heads, keys in [(1, 1, 1), (3, 3, 1000), (64, 8, 32768), (7, 2, 33)]:
            s = plan_splits(batch, heads, keys, tile=tile)
            assert s.split_tokens % tile == 0
            assert s.num_splits * s.split_tokens >= keys > (s.num_splits - 1) * s.split_tokens


# -- prefill / extend -------------------------------------------------------------------------
# fresh prompt, a decode row, a prefix hit (7 new over 33 cached), a chunk at a block edge, 3 new over 67
MIXED = [(6, 6), (1, 37), (7, 40), (16, 32), (3, 70)]


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), DTYPES, ids=DTYPE_IDS)
def test_prefill_every_kv_dtype(kv_dtype: str, q_dtype: str) -> None:
    check(make_case(MIXED, (4, 2), 16, 4, kv_dtype, q_dtype, seed=5))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa3", "mqa"])
def test_prefill_heads_and_block_sizes(heads: tuple[int, int], block_size: int) -> None:
    check(make_case(MIXED, heads, 16, block_size, "bf16", "bf16", seed=block_size))


@pytest.mark.parametrize("window", [1, 4, 9, 64])
def test_prefill_sliding_window(window: int) -> None:
    check(make_case(MIXED + [(20, 20)], (4, 2), 16, 4, "fp16", "fp16", seed=window), window)


def test_prefill_long_chunk_over_prefix() -> None:
    """A chunk spanning several query tiles over a cached prefix (chunked prefill)."""
    check(make_case([(40, 90), (33, 33)], (4, 2), 16, 16, "int8", "fp32", seed=11))


@pytest.mark.parametrize(("kv_dtype", "q_dtype", "window"), [("bf16", "bf16", None), ("int4", "fp16", 9)])
def test_compiled_tile_sizes(monkeypatch: pytest.MonkeyPatch, kv_dtype: str, q_dtype: str, window: int | None) -> None:
    """The prefill tiles the compiled kernels use on a GPU (64 x 32), checked here too: a chunk
    over several tiles, next to a decode step over several splits."""
    from worker.kernels import triton_prefill
    monkeypatch.setattr(triton_prefill, "tile_sizes", lambda: (64, 32))
    check(make_case([(70, 150), (1, 40), (5, 5)], (4, 2), 16, 16, kv_dtype, q_dtype, seed=13), window)
    check(make_case([(1, 150), (1, 40), (1, 5)], (4, 2), 16, 16, kv_dtype, q_dtype, seed=14), window)


# -- H2O scores -------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv_dtype", "window"), [("fp32", None), ("fp8", None), ("fp16", 9)])
def test_decode_collects_scores(kv_dtype: str, window: int | None) -> None:
    """Decode steps collect H2O scores in the kernel: the same weights the reference adds."""
    q_dtype = "fp32" if kv_dtype in ("fp32", "fp8") else kv_dtype
    seqs = [(1, n) for n in (1, 12, 40)]
    ours = make_case(seqs, (4, 2), 16, 4, kv_dtype, q_dtype, seed=2, collect_scores=True)
    ref = make_case(seqs, (4, 2), 16, 4, kv_dtype, q_dtype, seed=2, collect_scores=True)
    out = triton_attention.paged_attention(ours.query, ours.k_cache, ours.v_cache, ours.meta, 0.25, window)
    want = reference.paged_attention(ref.query, ref.k_cache, ref.v_cache, ref.meta, 0.25, window, allow_native=False)
    tol = TOL[ours.query.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    assert ours.meta.score_acc is not None and ref.meta.score_acc is not None
    torch.testing.assert_close(ours.meta.score_acc, ref.meta.score_acc, atol=1e-3 if tol > 1e-4 else 1e-5, rtol=1e-3)


def test_mixed_step_collecting_scores_runs_the_reference() -> None:
    """Prefill steps that collect scores take the torch path: identical results."""
    ours = make_case(MIXED, (4, 2), 16, 4, "fp32", "fp32", seed=4, collect_scores=True)
    ref = make_case(MIXED, (4, 2), 16, 4, "fp32", "fp32", seed=4, collect_scores=True)
    out = triton_attention.paged_attention(ours.query, ours.k_cache, ours.v_cache, ours.meta, 0.25)
    want = reference.paged_attention(ref.query, ref.k_cache, ref.v_cache, ref.meta, 0.25, allow_native=False)
    assert torch.equal(out, want)
    assert ours.meta.score_acc is not None and ref.meta.score_acc is not None
    assert torch.equal(ours.meta.score_acc, ref.meta.score_acc)


# -- compiled, without a GPU ------------------------------------------------------------------
@pytest.mark.multiproc
def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """Every kernel variant (each QUANT path, fp32 and bf16 queries, the launch tiles and warps)
    compiles to an sm_90 cubin with the LLVM and ptxas in the triton wheel: no GPU needed."""
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "-m", "worker.kernels.triton_compile", "--arch", "90", "--json", str(out)],
                          env=os.environ | {"TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert {r["name"].split("-q")[0] for r in rows} >= {"decode", "prefill", "kv-write"} and len(rows) == 17
    assert all(r["registers"] is None or r["registers"] <= 255 for r in rows)
