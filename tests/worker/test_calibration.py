"""int4 key scales (worker.calibration): exact when nothing is quantized, found where they
matter, and smaller int4 error than without them."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstore.keys import HashSalt
from worker.calibration import calibration_tokens, measure_key_scales
from worker.engine import Engine, EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = [(7 * i + 3) % 256 for i in range(96)]


def engine(path: Path, kv: str, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="fp32", kv_cache_dtype=kv, num_blocks=32, **kw))


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_power_of_two_scales_leave_plain_caches_bit_exact(tiny_model_dir, kind: str) -> None:
    eng = engine(tiny_model_dir(kind), "fp32")
    assert eng.model.key_scales is None          # only int4 is scaled
    ref = eng.logits(IDS)
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(1)
    scales = torch.exp2(torch.randint(-4, 5, (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                                      generator=gen).float())
    eng.model.set_key_scales(scales)
    assert torch.equal(eng.logits(IDS), ref)
    with pytest.raises(AssertionError, match="powers of two"):
        eng.model.set_key_scales(scales * 1.5)


def _lopsided_keys(src: Path, dst: Path, factor: float, pair: tuple[int, int], q_gain: float) -> None:
    """Copy a tiny model, making RoPE pair `pair` of every key head `factor` times larger and
    the same channels of every query head `factor` times smaller (q·k unchanged), and every
    query `q_gain` times larger (sharper attention than random weights give, so that key
    errors show in the logits)."""
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    for name in list(w):
        if name.endswith(("k_proj.weight", "q_proj.weight")):
            t = w[name].clone().view(-1, 16, w[name].shape[-1])  # [heads, head_dim, hidden]
            t[:, list(pair)] *= factor if "k_proj" in name else 1 / factor
            if "q_proj" in name:
                t *= q_gain
            w[name] = t.view(w[name].shape)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})


def test_scales_find_lopsided_channels_and_cut_int4_error(tiny_model_dir, tmp_path: Path) -> None:
    path = tmp_path / "lopsided"
    _lopsided_keys(tiny_model_dir("llama-gqa"), path, 64.0, (3, 11), q_gain=8.0)
    ref = engine(path, "fp32").logits(IDS)
    scaled, plain = engine(path, "int4"), engine(path, "int4", kv_key_scales=False)
    scales = scaled.model.key_scales
    assert scales is not None and plain.model.key_scales is None
    # s ~ (E q^2 / E k^2)^(1/4): channels 64x larger in k and 64x smaller in q get ~1/64 of
    # the others (powers of two; the others sit around 1)
    log2 = scales.log2()
    others = [c for c in range(16) if c not in (3, 11)]
    assert (log2[..., [3, 11]] - log2[..., others].median(-1, keepdim=True).values <= -3).all()
    err_scaled = (scaled.logits(IDS) - ref).abs().mean()
    err_plain = (plain.logits(IDS) - ref).abs().mean()
    # measured 0.52 (what is left is mostly the values' int4 error, which scales do not touch)
    assert err_scaled < 0.65 * err_plain, (float(err_scaled), float(err_plain))
    # blocks quantized under other scales must never be shared
    assert scaled.salt != plain.salt


def test_measure_is_deterministic_and_restores_nothing(tiny_model_dir) -> None:
    eng = engine(tiny_model_dir("llama-mqa"), "int4")
    first = eng.model.key_scales
    assert first is not None and first.shape == (2, 1, 16)
    toks = calibration_tokens(None, 256, 512)
    assert len(toks) == 512
    again = measure_key_scales(eng.model, toks, 512)
    assert torch.equal(again, first)
    assert eng.model.key_scales is None          # measuring takes the scales off
    with pytest.raises(ValueError, match="at least 2 tokens"):
        measure_key_scales(eng.model, [1], 512)


def test_salt_field_is_absent_when_empty() -> None:
    base = HashSalt(model="m", tokenizer="t", kv_cache_dtype="int4", block_size=16)
    assert base.digest() == HashSalt("m", "t", "int4", 16, kv_codec="").digest()
    assert base.digest() != HashSalt("m", "t", "int4", 16, kv_codec="key-scales:00").digest()
