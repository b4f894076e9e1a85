"""int4 key calibration (worker.model.calibration): scales exact and the shift softmax-invariant when
nothing is quantized; both found where they matter, and each cuts the int4 error."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstore.keys import HashSalt
from worker.engine.engine import Engine, EngineConfig
from worker.model.calibration import calibration_tokens, measure_key_calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = [(7 * i + 3) % 256 for i in range(96)]


def engine(path: Path, kv: str, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="fp32", kv_cache_dtype=kv, num_blocks=32, **kw))


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_power_of_two_scales_leave_plain_caches_bit_exact(tiny_model_dir, kind: str) -> None:
    eng = engine(tiny_model_dir(kind), "fp32")
    assert eng.runner.model.key_scales is None          # only int4 is scaled
    ref = eng.logits(IDS)
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(1)
    scales = torch.exp2(torch.randint(-4, 5, (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                                      generator=gen).float())
    eng.runner.model.set_key_scales(scales)
    assert torch.equal(eng.logits(IDS), ref)
    with pytest.raises(AssertionError, match="powers of two"):
        eng.runner.model.set_key_scales(scales * 1.5)
    # a shift moves every logit of a query by the same amount: attention unchanged up to rounding
    shift = torch.randn(scales.shape, generator=gen)
    eng.runner.model.set_key_scales(scales, shift)
    torch.testing.assert_close(eng.logits(IDS), ref, atol=1e-4, rtol=1e-4)


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
    scaled, plain = engine(path, "int4"), engine(path, "int4", kv_calibration=False)
    scales = scaled.runner.model.key_scales
    assert scales is not None and plain.runner.model.key_scales is None
    # s ~ (E q^2 / E k^2)^(1/4): channels 64x larger in k and 64x smaller in q get ~1/64 of
    # the others (powers of two; the others sit around 1)
    log2 = scales.log2()
    others = [c for c in range(16) if c not in (3, 11)]
    assert (log2[..., [3, 11]] - log2[..., others].median(-1, keepdim=True).values <= -3).all()
    scaled.runner.model.set_key_scales(scales)         # the scales alone, no shift
    err_scaled = (scaled.logits(IDS) - ref).abs().mean()
    err_plain = (plain.logits(IDS) - ref).abs().mean()
    # measured 0.52 (what is left is mostly the values' int4 error, which scales do not touch)
    assert err_scaled < 0.65 * err_plain, (float(err_scaled), float(err_plain))
    # blocks quantized under other scales must never be shared
    assert scaled.salt != plain.salt


def test_shift_finds_key_offsets_and_cuts_int4_error(tiny_model_dir, tmp_path: Path) -> None:
    # keys with a large common offset: a big k_proj bias on the two lowest-frequency RoPE pairs
    # (channels 6, 7, 14, 15 of 16), which barely rotate over the text, so the offset survives
    # RoPE and int4 spends its range on it
    path = tmp_path / "offset"
    shutil.copytree(tiny_model_dir("qwen2-bias"), path)
    w = load_file(path / "model.safetensors")
    for name in list(w):
        if name.endswith("k_proj.bias"):
            b = w[name].clone().view(-1, 16)                # [kv heads, head_dim]
            b[:, [6, 7, 14, 15]] = 16.0
            w[name] = b.view(-1)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    plain, eng = engine(path, "fp32"), engine(path, "int4")
    cal = measure_key_calibration(eng.runner.model, calibration_tokens(None, 256, 512))
    # post-RoPE q and k of the unquantized model, on another text
    cfg = eng.model_config
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(cfg.num_layers)}
    plain.runner.model.observer = lambda layer, q, k: seen[layer].append((q.clone(), k.clone()))  # per chunk
    plain.logits(IDS)
    plain.runner.model.observer = None
    codec = eng.store.kv.k_caches[0].codec
    group = cfg.num_heads // cfg.num_kv_heads

    def qk_error(shift: torch.Tensor) -> float:
        """mean |q·k - q·k̂| over every query/key pair, keys int4-quantized as the engine caches them"""
        errs = []
        for layer in range(cfg.num_layers):
            q, k = (torch.cat(t) for t in zip(*seen[layer]))                  # [T, Hq | Hkv, D]
            s, mu = cal.scales[layer], shift[layer]                            # [Hkv, D]
            k_hat = codec.dequantize(codec.quantize(k * s - mu), torch.float32) + mu
            q_s = q / s.repeat_interleave(group, 0)                            # [T, Hq, D]
            exact = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1))
            approx = torch.einsum("thd,shd->hts", q_s, k_hat.repeat_interleave(group, 1))
            errs.append((approx - exact).abs().mean())
        return float(torch.stack(errs).mean())

    with_shift, without = qk_error(cal.shift), qk_error(torch.zeros_like(cal.shift))
    # measured 0.39: without the shift, int4 spends its levels on the offset channels' range
    assert with_shift < 0.6 * without, (with_shift, without)
    # and the shift is the mean scaled post-RoPE key over the calibration text (past the
    # first 4 positions), read here from the unquantized engine's keys
    keys: dict[int, list[torch.Tensor]] = {i: [] for i in range(cfg.num_layers)}
    plain.runner.model.observer = lambda layer, q, k: keys[layer].append(k.double())
    plain.logits(calibration_tokens(None, 256, 512))
    plain.runner.model.observer = None
    mean = torch.stack([torch.cat(keys[i])[4:].mean(0) for i in range(cfg.num_layers)])
    torch.testing.assert_close(cal.shift, (mean * cal.scales).bfloat16().float())


def test_measure_is_deterministic_and_restores_nothing(tiny_model_dir) -> None:
    eng = engine(tiny_model_dir("llama-mqa"), "int4")
    first, first_shift = eng.runner.model.key_scales, eng.runner.model.key_shift
    assert first is not None and first.shape == (2, 1, 16) and first_shift is not None
    toks = calibration_tokens(None, 256, 512)
    assert len(toks) == 512
    again = measure_key_calibration(eng.runner.model, toks)
    assert torch.equal(again.scales, first) and torch.equal(again.shift, first_shift)
    assert eng.runner.model.key_scales is None and eng.runner.model.key_shift is None   # measuring takes them off
    assert again.digest() == measure_key_calibration(eng.runner.model, toks).digest()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        measure_key_calibration(eng.runner.model, [1])


def test_salt_field_is_absent_when_empty() -> None:
    base = HashSalt(model="m", tokenizer="t", kv_cache_dtype="int4", block_size=16)
    assert base.digest() == HashSalt("m", "t", "int4", 16, kv_codec="").digest()
    assert base.digest() != HashSalt("m", "t", "int4", 16, kv_codec="key-scales:00").digest()


def test_calibration_cache(tiny_model_dir, tmp_path: Path, monkeypatch, caplog) -> None:
    """The second int4 start reads the calibration back instead of measuring; a torn file is
    measured again and replaced; the key follows the weights and the tokens."""
    import worker.model.calibration as calibration
    monkeypatch.setattr(calibration, "calibration_cache_dir", lambda: tmp_path / "cal")
    src = tiny_model_dir("llama-gqa")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    measured = []
    real = calibration.measure_key_calibration

    def counting(*args, **kw):
        measured.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(calibration, "measure_key_calibration", counting)
    first = engine(path, "int4")
    assert len(measured) == 1 and len(list((tmp_path / "cal").glob("*.pt"))) == 1
    second = engine(path, "int4")
    assert len(measured) == 1, "the second start measured again"
    assert second.salt == first.salt
    assert torch.equal(second.runner.model.key_scales, first.runner.model.key_scales)
    assert torch.equal(second.runner.model.key_shift, first.runner.model.key_shift)
    prompt = [5, 9, 200, 31, 7, 66, 1, 42]
    assert torch.equal(second.logits(prompt), first.logits(prompt))

    (cached,) = (tmp_path / "cal").glob("*.pt")
    cached.write_bytes(cached.read_bytes()[:40])                     # torn
    with caplog.at_level("WARNING", logger="worker.model.calibration"):
        third = engine(path, "int4")
    assert len(measured) == 2 and "unreadable" in caplog.text and third.salt == first.salt
    assert torch.load(cached, weights_only=True)["digest"] == cached_digest(first)

    # new weights (same shapes, new file): a new key, measured again, a different salt
    weights = next(path.glob("*.safetensors"))
    w = load_file(weights)
    w = {k: v * 1.5 if "k_proj" in k else v for k, v in w.items()}
    save_file(w, weights, metadata={"format": "pt"})
    fourth = engine(path, "int4")
    assert len(measured) == 3 and fourth.salt != first.salt
    assert len(list((tmp_path / "cal").glob("*.pt"))) == 2
    toks = calibration_tokens(None, 256, 512)
    assert (calibration.calibration_cache_key(fourth.runner.model, path, toks, 16)
            != calibration.calibration_cache_key(fourth.runner.model, path, toks[:-1], 16))


def cached_digest(eng: Engine) -> str:
    from worker.model.calibration import KeyCalibration
    assert eng.runner.model.key_scales is not None and eng.runner.model.key_shift is not None
    return KeyCalibration(eng.runner.model.key_scales, eng.runner.model.key_shift).digest()


def test_calibration_cache_dir_unwritable(tiny_model_dir, tmp_path: Path, monkeypatch, caplog) -> None:
    import worker.model.calibration as calibration
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    monkeypatch.setattr(calibration, "calibration_cache_dir", lambda: blocker / "cal")
    with caplog.at_level("WARNING", logger="worker.model.calibration"):
        eng = engine(tiny_model_dir("llama-gqa"), "int4")
    assert eng.runner.model.key_scales is not None and "not cached" in caplog.text
