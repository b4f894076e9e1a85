"""Attention over a quantized paged cache, and engines running on quantized KV end to end.

Oracle for the kernels: dense SDPA over the dequantized K/V of each sequence (`gather_kv`),
so the quantized path must equal attention over exactly the values the cache holds, up to
fp32 rounding; a second, loose check compares with attention over the unquantized K/V.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from kvstore.layout import KVQuant
from kvstore.quant import KVCodec, QuantizedKV
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams
from worker.kernels.reference import AttnMetadata, gather_kv, paged_attention, write_kv

QUANT = {"fp8": KVQuant.FP8, "int8": KVQuant.INT8, "int4": KVQuant.INT4}
ALL_DTYPES = ["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
# relative L2 error of attention output vs unquantized K/V: a sanity bound, not a target.
# Keys are 3x N(0, 1), so attention is sharp and amplifies key error; measured maxima over
# these cases: int8 ~1%, fp8 ~9%, int4 ~25%.
LOOSE = {"int8": 0.03, "fp8": 0.15, "int4": 0.35}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    """q [q_len, Hq, D] over keys k, v [L, Hkv, D]; the new tokens are the last q_len positions."""
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    p = torch.arange(seq_len - q_len, seq_len)[:, None]
    t = torch.arange(seq_len)[None, :]
    mask = t <= p
    if sliding_window is not None:
        mask &= (p - t) < sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class Case(NamedTuple):
    query: torch.Tensor  # [T, Hq, D]
    k_cache: QuantizedKV
    v_cache: QuantizedKV
    meta: AttnMetadata
    keys: list[torch.Tensor]  # the unquantized dense [L_i, Hkv, D] per sequence
    values: list[torch.Tensor]
    block_tables: list[list[int]]


def make_case(dtype: str, seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, seed: int = 0, extra_blocks: int = 12,
              query_dtype: torch.dtype = torch.float32) -> Case:
    """`seqs` holds (query_len, seq_len); the prefix and the new tokens both go in via write_kv."""
    gen = torch.Generator().manual_seed(seed)
    codec = KVCodec(QUANT[dtype], head_dim)
    needed = [math.ceil(n / block_size) for _, n in seqs]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, at = [], 0
    for n in needed:
        block_tables.append(perm[at:at + n])
        at += n
    shape = (num_blocks, block_size, num_kv_heads)
    # finite garbage everywhere first: masked and unused slots must not matter
    k_cache = QuantizedKV(codec.quantize(10 * torch.randn(*shape, head_dim, generator=gen)), codec)
    v_cache = QuantizedKV(codec.quantize(10 * torch.randn(*shape, head_dim, generator=gen)), codec)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * 3 for _, n in seqs]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for _, n in seqs]
    prefix = [(n - q, row, k[:n - q], v[:n - q]) for (q, n), row, k, v in zip(seqs, block_tables, keys, values)
              if n > q]
    if prefix:  # an earlier step wrote the cached prefix
        pre = AttnMetadata.build([p[0] for p in prefix], [p[0] for p in prefix], [p[1] for p in prefix],
                                 block_size, "cpu")
        write_kv(torch.cat([p[2] for p in prefix]), torch.cat([p[3] for p in prefix]), k_cache, v_cache,
                 pre.slot_mapping)
    meta = AttnMetadata.build([q for q, _ in seqs], [n for _, n in seqs], block_tables, block_size, "cpu")
    new_k = torch.cat([k[n - q:] for k, (q, n) in zip(keys, seqs)])
    new_v = torch.cat([v[n - q:] for v, (q, n) in zip(values, seqs)])
    write_kv(new_k.to(query_dtype), new_v.to(query_dtype), k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(meta.num_tokens, num_q_heads, head_dim, generator=gen).to(query_dtype)
    return Case(query, k_cache, v_cache, meta, keys, values, block_tables)


def check(case: Case, sliding_window: int | None = None, dtype: str = "int8") -> None:
    head_dim = case.query.shape[-1]
    scale = head_dim ** -0.5
    out = paged_attention(case.query, case.k_cache, case.v_cache, case.meta, scale, sliding_window)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    qsl = case.meta.query_start_loc.tolist()
    exact_tol = {"atol": 1e-5, "rtol": 1e-4} if case.query.dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        k_hat, v_hat = gather_kv(case.k_cache, case.v_cache, case.block_tables[i], k.shape[0])
        q = case.query[qsl[i]:qsl[i + 1]].float()
        expected = dense_oracle(q, k_hat, v_hat, scale, sliding_window)  # what the cache holds
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), expected, **exact_tol)
        if case.query.dtype == torch.float32:
            exact = dense_oracle(q, k, v, scale, sliding_window)  # what was written
            rel = (expected - exact).norm() / exact.norm()
            assert rel < LOOSE[dtype], (dtype, rel.item())


HEADS = [(4, 4), (8, 2), (9, 3), (4, 1)]  # MHA, GQA, SmolLM2 GQA, MQA
HEAD_IDS = ["mha", "gqa", "gqa3", "mqa"]


@pytest.mark.parametrize("dtype", list(QUANT))
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_and_decode_batch(dtype: str, heads: tuple[int, int], block_size: int) -> None:
    seqs = [(6, 6), (1, 37), (7, 40), (1, 1), (1, 32), (3, 70)]
    check(make_case(dtype, seqs, *heads, head_dim=16, block_size=block_size, seed=block_size), dtype=dtype)


@pytest.mark.parametrize("dtype", list(QUANT))
@pytest.mark.parametrize("lens", [[1], [50], [5, 33, 17, 64]], ids=["one-token", "b1", "ragged"])
def test_decode_batch(dtype: str, lens: list[int]) -> None:
    case = make_case(dtype, [(1, n) for n in lens], 9, 3, head_dim=64, block_size=16, seed=len(lens))
    assert case.meta.is_decode
    check(case, dtype=dtype)


@pytest.mark.parametrize("dtype", list(QUANT))
@pytest.mark.parametrize("window", [1, 3, 8, 20])
def test_sliding_window(dtype: str, window: int) -> None:
    seqs = [(1, 45), (1, 5), (6, 6), (25, 25), (4, 33), (1, 18)]
    check(make_case(dtype, seqs, 6, 2, head_dim=8, block_size=4, seed=window), window, dtype=dtype)


@pytest.mark.parametrize("dtype", list(QUANT))
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_half_queries(dtype: str, query_dtype: torch.dtype) -> None:
    check(make_case(dtype, [(1, 30), (5, 12), (9, 9)], 4, 2, 32, block_size=4, query_dtype=query_dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", list(QUANT))
def test_write_kv_quantizes_only_its_slots(dtype: str) -> None:
    codec = KVCodec(QUANT[dtype], 8)
    k_cache = QuantizedKV(torch.zeros(5, 4, 2, codec.slot_bytes, dtype=torch.uint8), codec)
    v_cache = QuantizedKV(torch.zeros_like(k_cache.slots), codec)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([17, 2, 9])
    write_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.slots.view(-1, 2, codec.slot_bytes)
    assert torch.equal(flat_k[slots], codec.quantize(key))
    assert torch.equal(v_cache.slots.view(-1, 2, codec.slot_bytes)[slots], codec.quantize(value))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any()


def test_only_gathered_blocks_are_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel dequantizes the blocks it gathers, never the whole cache."""
    case = make_case("int4", [(1, 9), (5, 13), (1, 4)], 4, 2, 16, block_size=4, extra_blocks=40)
    rows: list[int] = []
    real = KVCodec.dequantize

    def spy(self: KVCodec, slots: torch.Tensor, dtype: torch.dtype, rotated: bool = False) -> torch.Tensor:
        rows.append(slots.numel() // slots.shape[-1])
        return real(self, slots, dtype, rotated)

    monkeypatch.setattr(KVCodec, "dequantize", spy)
    paged_attention(case.query, case.k_cache, case.v_cache, case.meta, 0.25)
    cache_rows = case.k_cache.slots.numel() // case.k_cache.slots.shape[-1]  # 48 blocks x 4 x 2 heads
    table_rows = sum(len(row) for row in case.block_tables) * 4 * 2  # 8 blocks x 4 x 2 heads
    assert rows and sum(rows) <= 2 * table_rows and max(rows) <= table_rows < cache_rows // 4


# -- engines on quantized KV -----------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine: Engine, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_tiny_engine_with_every_kv_dtype(tiny_model_dir, dtype: str) -> None:
    """generate + prefix caching + preemption, integrity checked after every step."""
    path = str(tiny_model_dir("llama-gqa"))
    shared = list(range(3, 23))  # 5 blocks of a shared prefix
    prompts = [shared + [30 + i, 40 + i, 50 + i] for i in range(6)]
    roomy = Engine(EngineConfig(model=path, block_size=4, num_blocks=128, kv_cache_dtype=dtype,
                                check_integrity=True, max_model_len=64))
    assert roomy.layout.kv_cache_dtype == dtype
    assert roomy.store.kv.nbytes == roomy.layout.bytes_per_block * 128
    first = _run(roomy, prompts)
    assert all(len(t) == 12 for t in first)
    # arriving together, the six compute the shared prefix once: five wait a step and reuse it
    assert roomy.stats().prefix_hits == 5 * 5 and roomy.stats().num_prefix_waits == 5
    again = roomy.generate(prompts[:2] + [shared + [99]], GREEDY)  # prefixes now come from the cache
    assert [o.token_ids for o in again[:2]] == first[:2]
    assert [o.num_cached_tokens for o in again] == [20, 20, 20]
    assert roomy.stats().prefix_hits > 0
    # a pool too small for the batch: the scheduler preempts and recomputes
    tight = Engine(EngineConfig(model=path, block_size=4, num_blocks=24, kv_cache_dtype=dtype,
                                check_integrity=True, max_model_len=64, enable_prefix_caching=False))
    assert _run(tight, prompts) == first
    assert tight.stats().num_preemptions > 0
    assert tight.store.pool.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["mistral-swa", "llama-mqa", "qwen2-bias", "llama3-rope"])
@pytest.mark.parametrize("dtype", ["fp8", "int4"])
def test_tiny_kinds_with_chunked_prefill(tiny_model_dir, kind: str, dtype: str) -> None:
    """Sliding windows, MQA, q/k/v biases and chunked prefill (8-token chunks) on quantized KV."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir(kind)), block_size=4, num_blocks=64, kv_cache_dtype=dtype,
                                 check_integrity=True, max_model_len=64, max_num_batched_tokens=8))
    outs = engine.generate([list(range(5, 30)), list(range(40, 51))], GREEDY)
    assert [o.completion_tokens for o in outs] == [12, 12]
    assert engine.store.pool.num_used_blocks == 0


def _agreement(reference: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> float:
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return same / sum(len(r) for r in reference)


@pytest.mark.slow
def test_smollm2_with_every_kv_dtype(smollm2_dir) -> None:
    """Every KV dtype generates on the real model with integrity checks; int8 agrees with fp32.
    fp32 weights: on the default (Q4_1, int8-input kernels) a KV dtype's rounding moves activation
    codes, and free-running greedy agreement measures that rather than the KV dtype."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[tuple[int, ...]]] = {}
    forced: dict[str, list[list[int]]] = {}
    for dtype in ALL_DTYPES:
        engine = Engine(EngineConfig(model=str(smollm2_dir), dtype="fp32", weight_dtype="fp32", kv_cache_dtype=dtype,
                                     num_blocks=64, check_integrity=True))
        ids = [engine.encode(p) for p in prompts]
        outputs[dtype] = [o.token_ids for o in engine.generate(ids, params)]
        ref = outputs["fp32"]
        # teacher-forced: this cache's greedy choice after each token of the fp32 continuation
        forced[dtype] = [engine.logits(p + list(r))[len(p) - 1:-1].argmax(-1).tolist() for p, r in zip(ids, ref)]
        assert engine.store.pool.num_used_blocks == 0
        del engine
    assert _agreement(outputs["fp32"], outputs["fp16"]) >= 0.9
    assert _agreement(forced["fp32"], forced["int8"]) >= 0.95
    assert _agreement(outputs["fp32"], outputs["int8"]) >= 0.5
    for dtype in ("fp8", "int4"):
        assert _agreement(forced["fp32"], forced[dtype]) >= 0.6, dtype


def test_block_hash_salt_includes_the_kv_dtype(tiny_model_dir) -> None:
    """Blocks quantized differently never share a hash (prefix cache, index, peers)."""
    path = str(tiny_model_dir("llama-gqa"))
    salts = {d: Engine(EngineConfig(model=path, block_size=4, num_blocks=8, kv_cache_dtype=d)).salt
             for d in ALL_DTYPES}
    assert len(set(salts.values())) == len(ALL_DTYPES)
