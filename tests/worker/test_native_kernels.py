"""The native CPU decode kernel (worker/kernels/csrc/paged_decode.cpp) against the dense
oracle, its fallback, and its input checks.

`make setup` builds the kernel, so these tests expect it: a machine that cannot build it
(no C++ compiler) fails `test_kernel_is_built` rather than skipping the rest.
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.worker.test_kernels import check, dense_oracle, make_case
from worker.kernels import native
from worker.kernels.reference import paged_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}


def kernel(case, window: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    meta = case.meta
    return native.paged_decode(case.query, case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens,
                               case.query.shape[-1] ** -0.5, window)


def test_kernel_is_built() -> None:
    assert native.load() is not None, "the native CPU kernels did not build (see the warning above)"


@pytest.mark.parametrize("head_dim", [8, 12, 64, 128])  # 12: the plain C++ loops (not a multiple of 8)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (4, 1), (32, 2)], ids=["mha", "gqa3", "gqa", "mqa", "g16"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_matches_dense_oracle(head_dim: int, heads: tuple[int, int], block_size: int, threads: int) -> None:
    lens = [1, 2, 7, 16, 17, 33, 64, 5]
    case = make_case([(1, n) for n in lens], *heads, head_dim=head_dim, block_size=block_size,
                     seed=head_dim + block_size, extra_cols=2)
    out = kernel(case)
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        expected = dense_oracle(case.query[i:i + 1], k, v, head_dim ** -0.5, None)
        torch.testing.assert_close(out[i:i + 1], expected, **TOL)


@pytest.mark.parametrize("window", [1, 3, 16, 40])
def test_sliding_window(window: int, threads: int) -> None:
    lens = [1, 3, 15, 16, 17, 40, 41]
    case = make_case([(1, n) for n in lens], 6, 2, head_dim=16, block_size=4, seed=window)
    out = kernel(case, window)
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        expected = dense_oracle(case.query[i:i + 1], k, v, 0.25, window)
        torch.testing.assert_close(out[i:i + 1], expected, **TOL)


def test_large_logits_stay_finite() -> None:
    """Scores in the thousands: the max-subtracted softmax and the vector exp stay exact."""
    case = make_case([(1, 50), (1, 3)], 4, 2, head_dim=16, block_size=4)
    big = case._replace(query=case.query * 300)
    out = kernel(big)
    assert torch.isfinite(out).all()
    for i, (k, v) in enumerate(zip(big.keys, big.values)):
        torch.testing.assert_close(out[i:i + 1], dense_oracle(big.query[i:i + 1], k, v, 0.25, None), **TOL)


def test_paged_attention_uses_it_for_every_fp32_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure decode batch and every row of a mixed batch (prefill tokens as decode rows of their
    own) go through the kernel, in one call; score collection and half-precision caches do not."""
    calls: list[int] = []
    real = native.paged_decode

    def spy(query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(query.shape[0])
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "paged_decode", spy)
    check(make_case([(1, 30), (1, 9), (1, 17)], 4, 2, 8, block_size=4))
    check(make_case([(1, 30), (6, 6), (3, 20), (1, 9)], 4, 2, 8, block_size=4), sliding_window=5)
    assert calls == [3, 11]
    check(make_case([(1, 30), (1, 9)], 4, 2, 8, block_size=4, cache_dtype=torch.float16))
    case = make_case([(1, 30), (6, 8)], 4, 2, 8, block_size=4)
    meta = type(case.meta).build(case.meta.query_lens_list, case.meta.seq_lens_list, case.block_tables, 4,
                                 collect_scores=True)
    paged_attention(case.query, case.k_cache, case.v_cache, meta, 0.5)
    assert calls == [3, 11]


def test_token_rows_are_built_once_per_step() -> None:
    """Each new token's row: its sequence's block table and its position + 1 as its length;
    built by the first layer and reused, and no torch decode plan is built."""
    case = make_case([(1, 30), (1, 9), (5, 17), (1, 12)], 4, 2, 8, block_size=4)
    for _ in range(3):  # three layers
        check(case)
    rows = case.meta.token_rows()
    assert rows.rows.tolist() == list(range(8)) and rows.seq_lens.tolist() == [30, 9, 13, 14, 15, 16, 17, 12]
    assert torch.equal(rows.block_tables[2:7], case.meta.block_tables[2].expand(5, -1))
    assert case.meta.token_rows() is rows and not case.meta._plans


def test_a_prompt_attends_alike_whole_in_chunks_and_token_by_token() -> None:
    """The attention of a prompt's tokens is the same bits whichever way the prompt is cut into
    steps, and beside another sequence: each token runs the decode kernel's arithmetic."""
    whole = make_case([(23, 23)], 9, 3, 16, block_size=4, seed=3)
    q, kc, vc, table = whole.query, whole.k_cache, whole.v_cache, whole.block_tables[0]
    expected = paged_attention(q, kc, vc, whole.meta, 0.25)
    for chunk in (1, 4, 16):
        parts = []
        for start in range(0, 23, chunk):
            n = min(chunk, 23 - start)
            meta = type(whole.meta).build([n], [start + n], [table], 4)
            parts.append(paged_attention(q[start:start + n], kc, vc, meta, 0.25))
        assert torch.equal(torch.cat(parts), expected), chunk
    other = make_case([(5, 11)], 9, 3, 16, block_size=4, seed=4)
    rows = torch.cat([other.query, q[10:15]])
    kc2, vc2 = torch.cat([kc, other.k_cache]), torch.cat([vc, other.v_cache])
    shift = kc.shape[0]
    meta = type(whole.meta).build([5, 5], [11, 15], [[b + shift for b in other.block_tables[0]], table], 4)
    assert torch.equal(paged_attention(rows, kc2, vc2, meta, 0.25)[5:], expected[10:15])


def test_falls_back_to_torch_when_it_cannot_build(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(native, "build", broken)
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native.load() is None
            case = make_case([(1, 30), (1, 9)], 4, 2, 8, block_size=4)
            assert not native.decode_supported(case.query, case.k_cache, case.v_cache)
            check(case)  # the torch path
        assert "no compiler here" in caplog.text
    finally:
        native.load.cache_clear()


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_bad_input_raises_instead_of_reading_out_of_bounds() -> None:
    case = make_case([(1, 30), (1, 9)], 4, 2, 8, block_size=4)
    meta = case.meta
    bad_table = meta.block_tables.clone()
    bad_table[0, 0] = case.k_cache.shape[0]  # past the pool
    with pytest.raises(RuntimeError, match="block id out of range"):
        native.paged_decode(case.query, case.k_cache, case.v_cache, bad_table, meta.seq_lens, 0.5, None)
    too_long = meta.seq_lens.clone()
    too_long[1] = meta.block_tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        native.paged_decode(case.query, case.k_cache, case.v_cache, meta.block_tables, too_long, 0.5, None)
    with pytest.raises(RuntimeError, match="fp32 only"):
        native.paged_decode(case.query.double(), case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens,
                            0.5, None)
    with pytest.raises(RuntimeError, match="query heads per kv head"):
        q = torch.randn(2, 34, 8)
        native.paged_decode(q, case.k_cache, case.v_cache, meta.block_tables, meta.seq_lens, 0.5, None)


def test_kernels_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    assert native.build_dir().parent == tmp_path
    monkeypatch.delenv(native.ENV_DIR)
    from worker.model.loader import cache_root

    assert native.build_dir().parent == cache_root() / "kernels"


# -- copy_blocks: KV blocks between the pool and the host tier (csrc/block_copy.cpp) ---------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_host_tier_with_native_copy_equals_the_torch_copies(dtype: str, threads: int) -> None:
    from kvstore.pool import BlockId
    from kvstore.tensors import KVTensors
    from kvstore.tiers import HostTier
    from tests.kvstore.test_tiers import H, filled, layout

    lay = layout(dtype)
    dev = filled(lay, 9, seed=3)
    tiers = [HostTier(lay, 5), HostTier(lay, 5, copy_blocks=native.block_copier())]
    assert tiers[1]._copy_blocks is not None
    ids = [BlockId(7), BlockId(0), BlockId(4), BlockId(2)]
    outs = []
    for tier in tiers:
        tier.offload(dev, ids, [H(i) for i in ids])
        back = KVTensors(lay, 9)
        tier.onload(back, [H(4), H(7)], [BlockId(1), BlockId(8)])
        read = tier.read([H(2), H(0)])
        tier.store([H(20), H(21)], read)        # as a peer's blocks arrive; evicts the oldest
        outs.append((back.kv.clone(), read, tier.read([H(20), H(21)]), tier.data.clone()))
        tier.check_integrity()
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(outs[1][0][:, :, 1], dev.kv[:, :, 4]) and torch.equal(outs[1][0][:, :, 8], dev.kv[:, :, 7])
    assert torch.equal(outs[1][1], dev.kv[:, :, [2, 0]])


def test_copy_blocks_rejects_out_of_range_ids() -> None:
    from kvstore.tensors import KVTensors
    from tests.kvstore.test_tiers import layout

    pool = KVTensors(layout(), 4).kv
    host = torch.zeros(2, *pool.shape[:2], *pool.shape[3:])
    with pytest.raises(RuntimeError, match="out of range"):
        native.block_copier()(host, torch.tensor([0]), pool, torch.tensor([4]), True)
    with pytest.raises(RuntimeError, match="out of range"):
        native.block_copier()(host, torch.tensor([2]), pool, torch.tensor([0]), True)
