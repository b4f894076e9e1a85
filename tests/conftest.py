"""Shared fixtures: the real default model and tiny random-weight HF models.

Tiny models have no tokenizer: tests feed them token ids (vocab 256). They are built with
a fixed seed, so every run and every process sees the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Fixtures from the shared harnesses, available to every test without an import.
pytest_plugins = ["tests.support.redis_server", "tests.support.redis_topologies"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the real SmolLM2 weights (the `smollm2_dir` fixture) is marked `smollm2`:
    seconds per test, so `make test-fast` leaves them out."""
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm2)


TINY_KINDS: tuple[str, ...] = (
    "llama-mha", "llama-gqa", "llama-mqa", "llama3-rope", "mistral-swa", "qwen2-bias",
)

_TINY_BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, dtype="float32",
)


def _tiny_config(kind: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kv_heads = {"llama-mha": 4, "llama-gqa": 2, "llama-mqa": 1}.get(kind, 2)
    kw = _TINY_BASE | {"num_key_value_heads": kv_heads}
    if kind == "llama-gqa":
        kw["tie_word_embeddings"] = True  # the one tied model, like SmolLM2
    if kind == "llama3-rope":
        kw["rope_parameters"] = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64)
    kw |= overrides
    if kind in ("llama-mha", "llama-gqa", "llama-mqa", "llama3-rope"):
        return LlamaConfig(**kw)
    if kind == "mistral-swa":
        return MistralConfig(**({"sliding_window": 8} | kw))
    if kind == "qwen2-bias":
        return Qwen2Config(**({"use_sliding_window": False} | kw))
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct dir (converted on first use; `make setup` does it once)."""
    from worker.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2", progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(kind, **config_overrides) -> Path`: a tiny random HF model saved as safetensors.

    Kinds: llama-mha (4 heads / 4 kv), llama-gqa (4/2, tied embeddings), llama-mqa (4/1),
    llama3-rope, mistral-swa (sliding_window 8), qwen2-bias (non-zero q/k/v biases). All:
    hidden 64, 2 layers, head_dim 16, vocab 256, intermediate 128, 512 positions, fp32.
    Same arguments → the same directory (built once per session).
    """
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def make(kind: str, **overrides: Any) -> Path:
        key = f"{kind}|{sorted(overrides.items())!r}"
        if key in built:
            return built[key]
        config = _tiny_config(kind, overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith(".bias"):  # HF initialises biases to zero; make them matter
                        param.normal_(0.0, 0.5)
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path, safe_serialization=True)
        built[key] = path
        return path

    return make


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module of small-tensor tests: fast when other jobs share the cores.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """int4 engines built in this process cache their key calibration in a temp dir, not in
    the user's cache (where it would pile up one file per run for the tiny models)."""
    import worker.model.calibration
    path = tmp_path_factory.mktemp("calibration-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker.model.calibration, "calibration_cache_dir", lambda: path)
        yield path
