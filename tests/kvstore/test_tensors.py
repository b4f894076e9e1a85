"""KVTensors: sizes match KVLayout exactly; block moves match a clone-and-index oracle."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvstore.layout import KVLayout
from kvstore.tensors import KVTensors, torch_dtype

LAYOUTS = [
    KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, kv_cache_dtype="fp32"),  # SmolLM2-135M
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=1, kv_cache_dtype="fp16"),
    KVLayout(num_layers=3, num_kv_heads=4, head_dim=16, block_size=32, kv_cache_dtype="bf16"),
    KVLayout(num_layers=1, num_kv_heads=2, head_dim=6, block_size=5, kv_cache_dtype="fp32"),
]


def small(dtype: str = "fp32", block_size: int = 4) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=block_size, kv_cache_dtype=dtype)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.kv_cache_dtype}-bs{lay.block_size}")
@pytest.mark.parametrize("num_blocks", [1, 7])
def test_nbytes_equals_layout_formula(layout: KVLayout, num_blocks: int) -> None:
    kv = KVTensors(layout, num_blocks)
    assert kv.nbytes == layout.bytes_per_block * num_blocks
    # and the tensors really are that big
    assert kv.kv.numel() * kv.kv.element_size() == kv.nbytes


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.kv_cache_dtype}-bs{lay.block_size}")
def test_per_layer_views_share_one_tensor(layout: KVLayout) -> None:
    kv = KVTensors(layout, 3)
    shape = (3, layout.block_size, layout.num_kv_heads, layout.head_dim)
    assert len(kv.k_caches) == len(kv.v_caches) == layout.num_layers
    for i in range(layout.num_layers):
        k, v = kv.layer(i)
        assert k.shape == v.shape == shape
        assert k.dtype == v.dtype == torch_dtype(layout.kv_cache_dtype)
        assert k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == kv.kv[i, 0].data_ptr() and v.data_ptr() == kv.kv[i, 1].data_ptr()
    kv.k_caches[-1][2, 0, 0, 0] = 5.0
    assert kv.kv[-1, 0, 2, 0, 0, 0].item() == 5.0
    assert kv.v_caches[-1].abs().sum().item() == 0.0


def test_pool_is_zero_filled() -> None:
    kv = KVTensors(small(), 4)
    assert not kv.kv.any()


def test_torch_dtype() -> None:
    assert torch_dtype("fp32") is torch.float32
    assert torch_dtype("fp16") is torch.float16
    assert torch_dtype("bf16") is torch.bfloat16
    for bad in ("int8", "auto", "float32"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            torch_dtype(bad)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_num_blocks_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVTensors(small(), num_blocks)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.kv_cache_dtype}-bs{lay.block_size}")
@pytest.mark.parametrize("extra", [0, 1, -1])
def test_for_budget_takes_whole_blocks(layout: KVLayout, extra: int) -> None:
    budget = 5 * layout.bytes_per_block + extra
    kv = KVTensors.for_budget(layout, budget, "cpu")
    assert kv.num_blocks == (4 if extra < 0 else 5)
    assert kv.nbytes <= budget < kv.nbytes + layout.bytes_per_block


def test_for_budget_below_one_block_raises() -> None:
    layout = small()
    with pytest.raises(ValueError, match="num_bytes"):
        KVTensors.for_budget(layout, layout.bytes_per_block - 1)


def filled(layout: KVLayout, num_blocks: int, seed: int = 0) -> KVTensors:
    kv = KVTensors(layout, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=gen).to(kv.dtype))
    return kv


def test_copy_blocks_matches_oracle_with_overlap() -> None:
    kv = filled(small(), 6)
    before = kv.kv.clone()
    kv.copy_blocks([1, 2, 5], [2, 3, 0])  # 2 is read and written: reads happen first
    expected = before.clone()
    for s, d in [(1, 2), (2, 3), (5, 0)]:
        expected[:, :, d] = before[:, :, s]
    assert torch.equal(kv.kv, expected)
    for i in range(kv.num_layers):  # per-layer views see the copy
        assert torch.equal(kv.k_caches[i][3], before[i, 0, 2])
        assert torch.equal(kv.v_caches[i][0], before[i, 1, 5])


def test_copy_blocks_accepts_tensors() -> None:
    kv = filled(small("bf16"), 4)
    before = kv.kv.clone()
    kv.copy_blocks(torch.tensor([0]), torch.tensor([3], dtype=torch.int32))
    assert torch.equal(kv.kv[:, :, 3], before[:, :, 0])
    assert torch.equal(kv.kv[:, :, :3], before[:, :, :3])


@pytest.mark.parametrize(("src", "dst", "match"), [
    ([0, 1], [2], "len"),
    ([0, 1], [2, 2], "repeats"),
    ([0], [4], "outside"),
    ([-1], [1], "outside"),
])
def test_copy_blocks_rejects_bad_ids(src: list[int], dst: list[int], match: str) -> None:
    kv = filled(small(), 4)
    before = kv.kv.clone()
    with pytest.raises(ValueError, match=match):
        kv.copy_blocks(src, dst)
    assert torch.equal(kv.kv, before)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_gather_scatter_round_trip_between_pools(dtype: str) -> None:
    layout = small(dtype, block_size=3)
    src = filled(layout, 7, seed=1)
    dst = filled(layout, 5, seed=2)
    dst_before = dst.kv.clone()
    data = src.gather_blocks([6, 0, 3])
    assert data.shape == (layout.num_layers, 2, 3, 3, layout.num_kv_heads, layout.head_dim)
    assert data.dtype == src.dtype
    data_copy = data.clone()
    src.kv.zero_()  # gather returned a copy, not a view
    assert torch.equal(data, data_copy)
    dst.scatter_blocks([4, 1, 2], data)
    expected = dst_before.clone()
    expected[:, :, [4, 1, 2]] = data
    assert torch.equal(dst.kv, expected)
    assert torch.equal(dst.k_caches[1][4], data[1, 0, 0])


def test_scatter_rejects_wrong_shape_or_dtype() -> None:
    kv = filled(small(), 4)
    good = kv.gather_blocks([0, 1])
    with pytest.raises(ValueError, match="shape"):
        kv.scatter_blocks([2], good)
    with pytest.raises(ValueError, match="dtype"):
        kv.scatter_blocks([2, 3], good.half())
    with pytest.raises(ValueError, match="repeats"):
        kv.scatter_blocks([2, 2], good)


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(1, 8), data=st.data())
def test_copy_blocks_property(num_blocks: int, data: st.DataObject) -> None:
    dst = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    src = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=len(dst), max_size=len(dst)))
    kv = filled(small(block_size=2), num_blocks, seed=num_blocks)
    before = kv.kv.clone()
    kv.copy_blocks(src, dst)
    expected = before.clone()
    for s, d in zip(src, dst):
        expected[:, :, d] = before[:, :, s]
    assert torch.equal(kv.kv, expected)
