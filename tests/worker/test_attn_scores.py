"""Attention-score accumulation (`AttnMetadata.score_acc`, the input of H2O eviction).

Oracle: a dense explicit softmax over each sequence's gathered cache (`gather_kv`), summed
over query heads and the sequence's new tokens; and, for the whole model, HF transformers'
eager attention weights summed over layers, heads and query rows.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AutoModelForCausalLM

from tests.worker import test_kernels as plain, test_quant_attention as quant
from worker.kernels.reference import AttnMetadata, gather_kv, paged_attention
from worker.model.llama import LlamaModel
from worker.model.loader import load_weights

TOL = {"atol": 1e-5, "rtol": 1e-5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_weights(q: torch.Tensor, k: torch.Tensor, scale: float, sliding_window: int | None,
                  decay: float = 1.0) -> torch.Tensor:
    """q [q_len, Hq, D] over k [L, Hkv, D] (new tokens last): softmax weight of each key,
    summed over heads and query rows (row j weighted decay ** (q_len - 1 - j)) -> [L]."""
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale  # [Hq, q, L]
    p = torch.arange(seq_len - q_len, seq_len)[:, None]
    t = torch.arange(seq_len)[None, :]
    mask = t <= p
    if sliding_window is not None:
        mask &= (p - t) < sliding_window
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # [Hq, q, L]
    weight = decay ** torch.arange(q_len - 1, -1, -1, dtype=torch.float64)  # [q]
    return (weight[:, None] * probs.sum(dim=0)).sum(0).float()


def with_scores(meta: AttnMetadata, decay: float = 1.0) -> AttnMetadata:
    """The same step with a fresh zero score accumulator."""
    return AttnMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                        meta.query_lens_list, meta.seq_lens_list,
                        torch.zeros(meta.num_seqs, meta.max_seq_len), decay)


def check_scores(query: torch.Tensor, k_cache, v_cache, meta: AttnMetadata, block_tables: list[list[int]],
                 sliding_window: int | None, out_tol: dict[str, float] = TOL, decay: float = 1.0) -> None:
    scale = query.shape[-1] ** -0.5
    plain_out = paged_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    collecting = with_scores(meta, decay)
    out = paged_attention(query, k_cache, v_cache, collecting, scale, sliding_window)
    torch.testing.assert_close(out, plain_out, **out_tol)
    acc = collecting.score_acc
    assert acc is not None and acc.shape == (meta.num_seqs, meta.max_seq_len)
    qsl = meta.query_start_loc.tolist()
    num_q_heads = query.shape[1]
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        k, _ = gather_kv(k_cache, v_cache, block_tables[i], seq_len, torch.float32)
        expected = dense_weights(query[qsl[i]:qsl[i + 1]].float(), k, scale, sliding_window, decay)
        torch.testing.assert_close(acc[i, :seq_len], expected, **TOL)
        assert not acc[i, seq_len:].any(), "positions past the sequence got weight"
        weight = sum(decay ** j for j in range(q_len))  # every query's row sums to 1 per head
        torch.testing.assert_close(acc[i].sum(), torch.tensor(float(num_q_heads * weight)))
    # a second layer's call adds the same weights again
    before = acc.clone()
    paged_attention(query, k_cache, v_cache, collecting, scale, sliding_window)
    torch.testing.assert_close(acc, 2 * before)


MIXED = [(6, 6), (1, 37), (7, 40), (1, 1), (1, 32), (3, 70)]


@pytest.mark.parametrize("window", [None, 1, 5, 20])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa3", "mqa"])
def test_mixed_batch(heads: tuple[int, int], block_size: int, window: int | None) -> None:
    case = plain.make_case(MIXED, *heads, head_dim=16, block_size=block_size, seed=block_size)
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, window)


@pytest.mark.parametrize("window", [None, 3, 30])
@pytest.mark.parametrize("lens", [[1], [50], [5, 33, 17, 64], [48, 48, 48]], ids=["one", "b1", "ragged", "equal"])
def test_decode_batch(lens: list[int], window: int | None) -> None:
    case = plain.make_case([(1, n) for n in lens], 9, 3, head_dim=32, block_size=4, seed=len(lens), extra_cols=1)
    assert case.meta.is_decode
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, window)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seqs", [[(12, 12)], [(9, 25), (4, 50)]], ids=["fresh", "cached-prefix"])
def test_prefill_only(seqs: list[tuple[int, int]], window: int | None) -> None:
    case = plain.make_case(seqs, 8, 2, head_dim=16, block_size=4, seed=5)
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, window)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", ["int8", "fp8", "int4"])
def test_quantized_cache(dtype: str, window: int | None) -> None:
    """fp8 / int4 run in the codec's rotated basis; the weights must still be the unrotated ones."""
    case = quant.make_case(dtype, MIXED, 8, 2, head_dim=16, block_size=4, seed=1)
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, window,
                 {"atol": 1e-5, "rtol": 1e-4})
    decode = quant.make_case(dtype, [(1, 9), (1, 30)], 8, 2, head_dim=16, block_size=4, seed=2)
    check_scores(decode.query, decode.k_cache, decode.v_cache, decode.meta, decode.block_tables, window,
                 {"atol": 1e-5, "rtol": 1e-4})


def test_half_cache() -> None:
    case = plain.make_case([(1, 30), (5, 12)], 4, 2, 16, block_size=4, cache_dtype=torch.bfloat16)
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, None)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8]), num_kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), window=st.one_of(st.none(), st.integers(1, 24)))
def test_scores_property(data: st.DataObject, block_size: int, num_kv_heads: int, group: int,
                         window: int | None) -> None:
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    seqs = [(data.draw(st.sampled_from([1, 1, n, data.draw(st.integers(1, n))])), n) for n in lens]
    case = plain.make_case(seqs, num_kv_heads * group, num_kv_heads, 8, block_size, seed=sum(lens))
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, window)


@pytest.mark.parametrize("decay", [0.5, 0.98])
def test_decayed_query_weights(decay: float) -> None:
    """With score_decay, new token j of a q-token chunk counts decay ** (q - 1 - j)."""
    case = plain.make_case(MIXED, 6, 2, head_dim=16, block_size=4, seed=11)
    check_scores(case.query, case.k_cache, case.v_cache, case.meta, case.block_tables, None, decay=decay)
    built = AttnMetadata.build([2], [5], [[0, 1]], 4, "cpu", collect_scores=True, score_decay=decay)
    assert built.score_decay == decay


def test_build_allocates_and_validates() -> None:
    meta = AttnMetadata.build([3, 1], [3, 9], [[0], [1, 2, 3]], 4, "cpu", collect_scores=True)
    assert meta.score_acc is not None and meta.score_acc.dtype == torch.float32
    assert meta.score_acc.shape == (2, 9) and not meta.score_acc.any()
    assert AttnMetadata.build([1], [2], [[0]], 4, "cpu").score_acc is None
    with pytest.raises(ValueError, match="score_acc"):
        AttnMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                     meta.query_lens_list, meta.seq_lens_list, torch.zeros(2, 8))


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-swa"])
def test_model_forward_sums_over_layers(tiny_model_dir, kind: str) -> None:
    """A prefill then a decode step of LlamaModel: score_acc equals HF's eager attention weights
    summed over layers, heads and query rows (sliding window 8 for mistral-swa)."""
    path = tiny_model_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = load_weights(path, dtype=torch.float32, device=torch.device("cpu"))
    model = LlamaModel(loaded.config, loaded.weights)
    cfg = loaded.config
    block_size, n = 4, 13
    caches = [(torch.zeros(8, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(8, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    ids = torch.randint(3, 250, (n + 1,), generator=torch.Generator().manual_seed(0))
    blocks = [5, 2, 7, 0]
    with torch.inference_mode():
        attns = hf(ids[None], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    per_key = torch.stack(attns).sum(dim=(0, 1, 2))  # [T query rows, T keys]
    prefill = AttnMetadata.build([n], [n], [blocks], block_size, "cpu", collect_scores=True)
    model.forward(ids[:n], torch.arange(n), caches, prefill)
    assert prefill.score_acc is not None
    torch.testing.assert_close(prefill.score_acc[0], per_key[:n, :n].sum(0), atol=1e-4, rtol=1e-4)
    decode = AttnMetadata.build([1], [n + 1], [blocks], block_size, "cpu", collect_scores=True)
    model.forward(ids[n:], torch.tensor([n]), caches, decode)
    assert decode.score_acc is not None
    torch.testing.assert_close(decode.score_acc[0], per_key[n], atol=1e-4, rtol=1e-4)
    assert abs(decode.score_acc.sum().item() - cfg.num_layers * cfg.num_heads) < 1e-4
