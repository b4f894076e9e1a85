"""Paged attention against a dense oracle.

Each case builds dense K/V per sequence first, scatters the cached prefix into a paged cache
under RANDOM non-contiguous block ids (the rest of the pool holds garbage), writes this
step's K/V with `write_kv` through `AttnMetadata.slot_mapping`, and compares
`paged_attention` with dense SDPA (explicit mask, GQA expanded by repeat_interleave).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from worker.kernels import native, reference
from worker.kernels.decode import _partition, decode_attention, plan_decode
from worker.kernels.reference import AttnMetadata, gather_kv, paged_attention, write_kv

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one thread keeps the file fast when other jobs share the cores (OpenMP
    spin-waits make a 2-thread op 10x slower on an oversubscribed machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, params=["native", "torch"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs twice: fp32 decode rows through the native kernel
    (worker.kernels.native), and through the torch path (gather + SDPA) it replaces on CPU."""
    if request.param == "torch":
        monkeypatch.setattr(native, "decode_supported", lambda *args: False)


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
    """q [q_len, Hq, D] over all L keys k, v [L, Hkv, D]; new tokens are the last q_len positions."""
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
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
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttnMetadata
    keys: list[torch.Tensor]  # dense [L_i, Hkv, D] per sequence
    values: list[torch.Tensor]
    block_tables: list[list[int]]


def make_case(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, seed: int = 0, extra_blocks: int = 3, extra_cols: int = 0,
              cache_dtype: torch.dtype = torch.float32) -> Case:
    """`seqs` holds (query_len, seq_len) per sequence; `extra_cols` pads every block table."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) + extra_cols for _, n in seqs]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, at = [], 0
    for n in needed:
        block_tables.append(perm[at:at + n])
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (10 * torch.randn(shape, generator=gen)).to(cache_dtype)  # garbage where unused
    v_cache = (10 * torch.randn(shape, generator=gen)).to(cache_dtype)
    keys, values = [], []
    for (q_len, seq_len), row in zip(seqs, block_tables):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
        t = torch.arange(seq_len - q_len)  # the cached prefix, placed by hand
        slots = torch.tensor(row)[t // block_size] * block_size + t % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[:seq_len - q_len].to(cache_dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[:seq_len - q_len].to(cache_dtype)
        keys.append(k)
        values.append(v)
    meta = AttnMetadata.build([q for q, _ in seqs], [n for _, n in seqs], block_tables, block_size, "cpu")
    new_k = torch.cat([k[n - q:] for k, (q, n) in zip(keys, seqs)])
    new_v = torch.cat([v[n - q:] for v, (q, n) in zip(values, seqs)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(meta.num_tokens, num_q_heads, head_dim, generator=gen)
    return Case(query, k_cache, v_cache, meta, keys, values, block_tables)


def check(case: Case, sliding_window: int | None = None) -> None:
    head_dim = case.query.shape[-1]
    scale = head_dim ** -0.5
    out = paged_attention(case.query, case.k_cache, case.v_cache, case.meta, scale, sliding_window)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    qsl = case.meta.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        k_paged, v_paged = gather_kv(case.k_cache, case.v_cache, case.block_tables[i], k.shape[0])
        torch.testing.assert_close(k_paged.float(), k, atol=0, rtol=0)
        torch.testing.assert_close(v_paged.float(), v, atol=0, rtol=0)
        expected = dense_oracle(case.query[qsl[i]:qsl[i + 1]], k, v, scale, sliding_window)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expected, **TOL)


HEADS = [(4, 4), (8, 2), (9, 3), (4, 1)]  # MHA, GQA, SmolLM2 GQA, MQA
HEAD_IDS = ["mha", "gqa", "gqa3", "mqa"]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_mixed_prefill_and_decode_batch(block_size: int, heads: tuple[int, int]) -> None:
    # fresh prompt, decode, prefill over a cached prefix (L > q_len), decode at a block edge
    seqs = [(6, 6), (1, 37), (7, 40), (1, 1), (1, 32), (3, 70)]
    check(make_case(seqs, *heads, head_dim=16, block_size=block_size, seed=block_size))


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("lens", [[1], [50], [5, 33, 17, 64], [48, 48, 48]], ids=["one-token", "b1", "ragged", "equal"])
def test_decode_batch(block_size: int, lens: list[int]) -> None:
    case = make_case([(1, n) for n in lens], 9, 3, head_dim=64, block_size=block_size, seed=len(lens))
    assert case.meta.is_decode
    check(case)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seqs", [[(12, 12)], [(30, 30), (5, 5)], [(9, 25)], [(4, 50), (20, 31)]],
                         ids=["fresh", "fresh-ragged", "cached-prefix", "cached-ragged"])
def test_prefill(block_size: int, seqs: list[tuple[int, int]]) -> None:
    check(make_case(seqs, 8, 2, head_dim=32, block_size=block_size, seed=7))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 8, 20])
def test_sliding_window(block_size: int, window: int) -> None:
    # windows shorter than most sequences; one sequence shorter than every window but 1 and 3
    seqs = [(1, 45), (1, 5), (6, 6), (25, 25), (4, 33), (1, 18)]
    check(make_case(seqs, 6, 2, head_dim=8, block_size=block_size, seed=window), window)


@pytest.mark.parametrize("window", [2, 10, 100])
def test_sliding_window_decode_only(window: int) -> None:
    case = make_case([(1, 70), (1, 3), (1, 40)], 4, 1, head_dim=8, block_size=4, seed=3)
    check(case, window)


def test_block_tables_wider_than_needed() -> None:
    # an engine may hand over rows with spare blocks already reserved; they must be ignored
    check(make_case([(1, 20), (3, 9), (1, 7)], 4, 2, 8, block_size=4, extra_cols=2), 5)
    check(make_case([(1, 20), (1, 9)], 4, 2, 8, block_size=4, extra_cols=3))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_half_cache_with_fp32_queries(cache_dtype: torch.dtype) -> None:
    check(make_case([(1, 30), (5, 12)], 4, 2, 16, block_size=4, cache_dtype=cache_dtype))


@settings(max_examples=50, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8, 16]), num_kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), head_dim=st.sampled_from([4, 8]),
       window=st.one_of(st.none(), st.integers(1, 24)))
def test_paged_attention_property(data: st.DataObject, block_size: int, num_kv_heads: int, group: int,
                                  head_dim: int, window: int | None) -> None:
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    seqs = [(data.draw(st.sampled_from([1, 1, n, data.draw(st.integers(1, n))])), n) for n in lens]
    check(make_case(seqs, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                    seed=sum(lens)), window)


def test_build_slot_mapping_matches_block_tables() -> None:
    meta = AttnMetadata.build([3, 1, 2], [3, 6, 9], [[7], [2, 5], [9, 0, 4]], block_size=4, device="cpu")
    # seq 0: positions 0..2 in block 7; seq 1: position 5 -> block 5 offset 1;
    # seq 2: positions 7, 8 -> block 0 offset 3, block 4 offset 0
    assert meta.slot_mapping.tolist() == [28, 29, 30, 21, 3, 16]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 6, 9]
    assert meta.block_tables.tolist() == [[7, 0, 0], [2, 5, 0], [9, 0, 4]]
    assert meta.slot_mapping.dtype == meta.block_tables.dtype == torch.int64
    assert (meta.num_seqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (3, 6, 3, 9)
    assert not meta.is_decode
    assert AttnMetadata.build([1, 1], [4, 1], [[3], [1]], 4, "cpu").is_decode


@pytest.mark.parametrize(("q", "n", "bt", "match"), [
    ([1, 1], [2], [[0]], "must match"),
    ([0], [2], [[0]], "query_len"),
    ([3], [2], [[0]], "query_len"),
    ([1], [9], [[0, 1]], "cannot hold"),
])
def test_build_rejects_bad_input(q: list[int], n: list[int], bt: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttnMetadata.build(q, n, bt, 4, "cpu")


def test_write_kv_touches_only_its_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 5, 3, 3, 4, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(2, 3, 3, 4, generator=gen)
    slots = torch.tensor([13, 0, 7])
    write_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.view(-1, 3, 4).clone(), before_v.view(-1, 3, 4).clone()
    expected_k[slots], expected_v[slots] = key, value
    assert torch.equal(k_cache.view(-1, 3, 4), expected_k)
    assert torch.equal(v_cache.view(-1, 3, 4), expected_v)


def test_kernels_never_sync_to_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes come from the metadata's Python lists: no .item()/.tolist()/int()/bool() on tensors."""
    mixed = make_case([(1, 30), (6, 6), (3, 20), (1, 9)], 4, 2, 8, block_size=4)
    decode = make_case([(1, 30), (1, 9)], 4, 2, 8, block_size=4)

    def sync(*args: object) -> None:
        raise AssertionError("host sync in a kernel")

    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for case in (mixed, decode):
        for window in (None, 5):
            paged_attention(case.query, case.k_cache, case.v_cache, case.meta, 0.5, window)
        new = case.query.new_zeros(case.meta.num_tokens, 2, 8)
        write_kv(new, new, case.k_cache, case.v_cache, case.meta.slot_mapping)


# -- decode grouping (worker.kernels.decode) -------------------------------------------------
def _brute_force_cost(keys: list[int], group_cost: int) -> int:
    """Cheapest split of sorted `keys` into runs, over every one of the 2^(n-1) cut sets."""
    n, best = len(keys), None
    for cuts in range(2 ** (n - 1)):
        bounds = [0] + [i + 1 for i in range(n - 1) if cuts >> i & 1] + [n]
        cost = sum((b - a) * keys[b - 1] + group_cost for a, b in zip(bounds, bounds[1:]))
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("group_cost", [0, 5, 40, 1000])
def test_partition_is_optimal(group_cost: int) -> None:
    gen = torch.Generator().manual_seed(group_cost)
    for n in (1, 2, 5, 9):
        keys = sorted(torch.randint(1, 60, (n,), generator=gen).tolist())
        bounds = _partition(keys, group_cost)
        assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(set(bounds))
        cost = sum((b - a) * keys[b - 1] + group_cost for a, b in zip(bounds, bounds[1:]))
        assert cost == _brute_force_cost(keys, group_cost)


@pytest.mark.parametrize("window", [None, 6, 30])
@pytest.mark.parametrize("group_cost", [0, 96, 10**9])
def test_decode_attention_under_any_grouping(group_cost: int, window: int | None) -> None:
    """Every grouping of the decode rows (one per length .. one for all) matches the dense
    oracle; the rows of a mixed batch keep their sequence ids."""
    seqs = [(1, 45), (5, 9), (1, 3), (1, 17), (1, 45), (6, 6), (1, 30), (1, 8)]
    case = make_case(seqs, 6, 2, head_dim=8, block_size=4, seed=group_cost % 97, extra_cols=1)
    meta = case.meta
    decode = [i for i, (q, _) in enumerate(seqs) if q == 1]
    plan = plan_decode(decode, meta.seq_lens_list, meta.seq_lens, meta.block_tables, 4, window, group_cost)
    assert sorted(plan.seqs) == decode
    covered = [i for g in plan.groups for i in g.seqs.tolist()]
    assert covered == plan.seqs and plan.groups[0].start == 0 and plan.groups[-1].stop == len(decode)
    if group_cost == 10**9:
        assert len(plan.groups) == 1 and plan.seqs == decode  # one group keeps the batch order
    if group_cost == 0 and window is None:
        assert len(plan.groups) == len({meta.seq_lens_list[i] for i in decode})
    qsl = meta.query_start_loc.tolist()
    rows = torch.tensor([qsl[i] for i in plan.seqs])
    out = decode_attention(case.query[rows], case.k_cache, case.v_cache, plan, 8 ** -0.5)
    for j, i in enumerate(plan.seqs):
        expected = dense_oracle(case.query[qsl[i]:qsl[i] + 1], case.keys[i], case.values[i], 8 ** -0.5, window)
        torch.testing.assert_close(out[j:j + 1], expected, **TOL)


def test_decode_plan_is_built_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "decode_supported", lambda *args: False)  # plans are the torch path's
    case = make_case([(1, 30), (1, 9), (1, 17)], 4, 2, 8, block_size=4)
    calls: list[int] = []
    real = reference.plan_decode

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reference, "plan_decode", spy)
    for _ in range(3):  # three layers
        check(case)
    assert len(calls) == 1
    check(case, sliding_window=5)  # another window is another plan
    assert len(calls) == 2
