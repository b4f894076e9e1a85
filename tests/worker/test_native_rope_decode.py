"""The fused decode kernel `native.rope_paged_decode` (RoPE + write_kv + paged attention of one
layer, csrc/paged_decode.cpp) against the steps it replaces, and the model's use of it."""
from __future__ import annotations

import pytest
import torch

from tests.worker.test_kernels import dense_oracle, make_case
from worker.kernels import native
from worker.kernels.backend import AttentionBackend, attention_ops
from worker.kernels.reference import AttnMetadata, paged_attention, write_kv
from worker.model.llama import LlamaModel, Rotary
from worker.model.loader import load_weights

TOL = {"atol": 1e-5, "rtol": 1e-5}


def rope_rows(positions: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed) [B, 1, D] of `positions`, built as worker.model.llama.Rotary builds them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq  # [B, D/2]
    cos = torch.cat((freqs, freqs), -1).cos()
    sin_signed = torch.cat((-freqs.sin(), freqs.sin()), -1)
    return cos[:, None], sin_signed[:, None]


@pytest.mark.parametrize("head_dim", [8, 12, 64])  # 12: the plain C++ attention loops
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (4, 1), (32, 2)], ids=["gqa3", "mha", "mqa", "g16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_equals_rope_write_kv_then_paged_attention(head_dim: int, heads: tuple[int, int], block_size: int,
                                                    window: int | None, threads: int) -> None:
    """k/v in the cache bit for bit as Rotary.apply + write_kv leave them, the output bit for bit
    paged_decode's of the Rotary.apply queries, and close to the dense oracle."""
    hq, hkv = heads
    lens = [1, 2, 17, 33, 5]
    case = make_case([(1, n) for n in lens], hq, hkv, head_dim=head_dim, block_size=block_size,
                     seed=head_dim + block_size, extra_cols=1)
    meta = case.meta
    b, width = len(lens), (hq + 2 * hkv) * head_dim
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(b, width + 3, generator=gen)[:, :width]  # a row stride wider than the row
    cos, sin_signed = rope_rows([n - 1 for n in lens], head_dim)
    scale = head_dim ** -0.5

    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    qk = Rotary.apply(qkv[:, :(hq + hkv) * head_dim].view(b, -1, head_dim), cos, sin_signed)
    q, k = qk[:, :hq], qk[:, hq:]
    write_kv(k, qkv[:, (hq + hkv) * head_dim:].view(b, hkv, head_dim), k_ref, v_ref, meta.slot_mapping)
    same_kernel = native.paged_decode(q.contiguous(), k_ref, v_ref, meta.block_tables, meta.seq_lens, scale, window)

    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = native.rope_paged_decode(qkv, cos, sin_signed, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                   meta.seq_lens, scale, window, hq)
    assert out.shape == (b, hq * head_dim)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(out, same_kernel.reshape(b, -1))
    torch_path = paged_attention(q, k_ref, v_ref, meta, scale, window, allow_native=False)
    torch.testing.assert_close(out, torch_path.reshape(b, -1), **TOL)
    for i, n in enumerate(lens):
        keys = k_ref.view(-1, hkv, head_dim)[[case.block_tables[i][t // block_size] * block_size + t % block_size
                                               for t in range(n)]]
        values = v_ref.view(-1, hkv, head_dim)[[case.block_tables[i][t // block_size] * block_size + t % block_size
                                                for t in range(n)]]
        expected = dense_oracle(q[i:i + 1], keys, values, scale, window)
        torch.testing.assert_close(out[i:i + 1].view(1, hq, head_dim), expected, **TOL)


def test_bad_input_raises_instead_of_writing_out_of_bounds() -> None:
    case = make_case([(1, 9), (1, 3)], 4, 2, 8, block_size=4)
    meta = case.meta
    qkv = torch.randn(2, 8 * 8)
    cos, sin_signed = rope_rows([8, 2], 8)
    bad_slots = meta.slot_mapping.clone()
    bad_slots[1] = case.k_cache.shape[0] * 4
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.rope_paged_decode(qkv, cos, sin_signed, case.k_cache, case.v_cache, bad_slots, meta.block_tables,
                                 meta.seq_lens, 0.5, None, 4)
    with pytest.raises(RuntimeError, match="qkv"):
        native.rope_paged_decode(qkv[:, :60], cos, sin_signed, case.k_cache, case.v_cache, meta.slot_mapping,
                                 meta.block_tables, meta.seq_lens, 0.5, None, 4)
    assert not native.rope_decode_supported(qkv, case.k_cache.half(), case.v_cache.half(), 4)
    assert not native.rope_decode_supported(qkv, case.k_cache, case.v_cache, 34)


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-swa", "qwen2-bias"])
def test_model_runs_decode_steps_through_it_bit_for_bit(tiny_model_dir, kind: str,  # type: ignore[no-untyped-def]
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaModel on the native backend: a decode step calls the fused kernel once per layer
    (a prefill, score collection and key scaling do not), and its logits and caches equal those
    of the same backend with the fused kernel removed (RoPE, write_kv, paged_attention apart)."""
    loaded = load_weights(tiny_model_dir(kind), dtype=torch.float32, device=torch.device("cpu"))
    cfg = loaded.config
    ops = attention_ops(AttentionBackend.NATIVE)
    fused = LlamaModel(cfg, loaded.weights, ops)
    apart = LlamaModel(cfg, loaded.weights, ops._replace(rope_decode=None))
    calls: list[int] = []
    real = native.rope_paged_decode

    def spy(qkv: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(qkv.shape[0])
        return real(qkv, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "rope_paged_decode", spy)
    block_size, lens, steps = 4, [11, 6], 12
    tables = [[5, 2, 7, 0, 9, 3], [1, 4, 6, 8, 10, 11]]
    caches = {m: [(torch.zeros(12, block_size, cfg.num_kv_heads, cfg.head_dim),
                   torch.zeros(12, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
              for m in ("fused", "apart")}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    prefill = AttnMetadata.build(lens, lens, tables, block_size, "cpu")
    last = torch.tensor([lens[0] - 1, sum(lens) - 1])
    logits = fused.forward(ids, positions, caches["fused"], prefill, last)
    assert torch.equal(logits, apart.forward(ids, positions, caches["apart"], prefill, last)) and not calls
    for step in range(steps):
        seq_lens = [n + step + 1 for n in lens]
        meta = AttnMetadata.build([1, 1], seq_lens, tables, block_size, "cpu")
        nxt, pos = logits.argmax(-1), torch.tensor([n - 1 for n in seq_lens])
        logits = fused.forward(nxt, pos, caches["fused"], meta)
        assert torch.equal(logits, apart.forward(nxt, pos, caches["apart"], meta)), step
    assert calls == [2] * cfg.num_layers * steps
    for (kf, vf), (ka, va) in zip(caches["fused"], caches["apart"]):
        assert torch.equal(kf, ka) and torch.equal(vf, va)
    seq_lens = [n + steps + 1 for n in lens]
    pos = torch.tensor([n - 1 for n in seq_lens])
    scored = AttnMetadata.build([1, 1], seq_lens, tables, block_size, "cpu", collect_scores=True)
    fused.forward(logits.argmax(-1), pos, caches["fused"], scored)
    fused.set_key_scales(torch.ones(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    fused.forward(logits.argmax(-1), pos, caches["fused"], AttnMetadata.build([1, 1], seq_lens, tables, block_size))
    assert len(calls) == cfg.num_layers * steps
