"""Model shapes the capacity planner sizes: built-in presets and HF `config.json` files.

Torch-free. `load_model_shape` resolves `kvmesh plan --model` (raising `PlanError`). A
`ModelShape` carries what the KV formula needs (layers, kv heads, head dim) plus what the
weights estimate needs (hidden and MLP sizes, vocabulary, tied embeddings, qkv biases).
Presets copy the public HF `config.json` of each model.

Parameters are counted for a Llama-family decoder (Llama 1/2/3, Mistral, Qwen2, SmolLM2):

    embed_tokens           vocab × hidden
    per layer  q, o        2 × hidden × heads × head_dim
               k, v        2 × hidden × kv_heads × head_dim
               qkv biases  (heads + 2 × kv_heads) × head_dim      (Qwen2 only)
               MLP         3 × hidden × intermediate              (gate, up, down)
               2 RMSNorms  2 × hidden
    final norm             hidden
    lm_head                vocab × hidden                          (0 when tied)

Rotary embeddings have no parameters. This reproduces the published counts
(LLaMA-7B 6,738,415,616; Llama-2-70B 68,976,648,192; Qwen2-7B 7,615,616,512).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class PlanError(ValueError):
    """Bad planner input; the message names the CLI flag, the value and what is accepted."""

    def __init__(self, flag: str, value: object, detail: str) -> None:
        self.flag, self.value, self.detail = flag, value, detail
        super().__init__(f"{flag} {value!r}: {detail}")


_INT_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_size", "intermediate_size", "vocab_size")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of one decoder model. Field names follow HF `config.json`."""

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # None: full attention in every layer
    max_position_embeddings: int | None = None
    attention_bias: bool = False  # biases on q, k, v projections (Qwen2)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        for name in ("sliding_window", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive integer or null")

    @property
    def num_params(self) -> int:
        """Parameter count of the decoder, as in the module docstring."""
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = 2 * h * q_out + 2 * h * kv_out
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_hidden_layers * layer + h + lm_head


def _get_int(config: Mapping[str, object], key: str, default: int | None = None) -> int | None:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} is not an integer")
    return value


def _require_int(config: Mapping[str, object], key: str) -> int:
    value = _get_int(config, key)
    if value is None:
        raise ValueError(f"{key} missing")
    return value


def shape_from_hf_config(config: Mapping[str, object], name: str) -> ModelShape:
    """Read a Llama-family HF `config.json` (already parsed). Raises ValueError naming the key.

    `num_key_value_heads` defaults to `num_attention_heads` (MHA); `head_dim` to
    hidden_size / num_attention_heads; `use_sliding_window: false` (Qwen2) means no window.
    """
    heads = _require_int(config, "num_attention_heads")
    hidden = _require_int(config, "hidden_size")
    head_dim = _get_int(config, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not a multiple of "
                             f"num_attention_heads={heads} and head_dim is absent")
        head_dim = hidden // heads
    window = _get_int(config, "sliding_window")
    if config.get("use_sliding_window") is False:
        window = None
    model_type = config.get("model_type")
    attention_bias = config.get("attention_bias", model_type == "qwen2")
    tied = config.get("tie_word_embeddings", False)
    for key, flag in (("attention_bias", attention_bias), ("tie_word_embeddings", tied)):
        if not isinstance(flag, bool):
            raise ValueError(f"{key}={flag!r} is not a boolean")
    assert isinstance(attention_bias, bool) and isinstance(tied, bool)
    return ModelShape(
        name=name,
        num_hidden_layers=_require_int(config, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_get_int(config, "num_key_value_heads", heads) or heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=_require_int(config, "intermediate_size"),
        vocab_size=_require_int(config, "vocab_size"),
        tie_word_embeddings=tied,
        sliding_window=window,
        max_position_embeddings=_get_int(config, "max_position_embeddings"),
        attention_bias=attention_bias,
    )


def _llama(name: str, layers: int, heads: int, kv_heads: int, hidden: int, inter: int,
           vocab: int, max_pos: int, *, window: int | None = None, tied: bool = False,
           bias: bool = False) -> ModelShape:
    return ModelShape(name=name, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads, hidden_size=hidden,
                      intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                      sliding_window=window, max_position_embeddings=max_pos,
                      attention_bias=bias)


PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in (
    _llama("llama-7b", 32, 32, 32, 4096, 11008, 32000, 2048),            # huggyllama/llama-7b
    _llama("llama-2-7b", 32, 32, 32, 4096, 11008, 32000, 4096),          # meta-llama/Llama-2-7b-hf
    _llama("llama-2-13b", 40, 40, 40, 5120, 13824, 32000, 4096),         # meta-llama/Llama-2-13b-hf
    _llama("llama-2-70b", 80, 64, 8, 8192, 28672, 32000, 4096),          # meta-llama/Llama-2-70b-hf
    _llama("llama-3-8b", 32, 32, 8, 4096, 14336, 128256, 8192),          # meta-llama/Meta-Llama-3-8B
    _llama("llama-3-70b", 80, 64, 8, 8192, 28672, 128256, 8192),         # meta-llama/Meta-Llama-3-70B
    _llama("mistral-7b", 32, 32, 8, 4096, 14336, 32000, 32768,           # mistralai/Mistral-7B-v0.1
           window=4096),
    _llama("qwen2-7b", 28, 28, 4, 3584, 18944, 152064, 131072,           # Qwen/Qwen2-7B
           bias=True),
    _llama("smollm2-135m", 30, 9, 3, 576, 1536, 49152, 8192,             # HuggingFaceTB/SmolLM2-135M
           tied=True),
)}


def load_model_shape(name_or_path: str) -> ModelShape:
    """A preset by name, or the `config.json` of a local HF model dir (or the file itself)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        detail = ("directory has no config.json" if path.is_dir() else
                  f"not a preset ({', '.join(PRESETS)}) nor a model dir/config.json")
        raise PlanError("--model", name_or_path, detail)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("top level is not a JSON object")
        name = (path if path.is_dir() else path.resolve().parent).name or str(path)
        return shape_from_hf_config(config, name)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlanError("--model", name_or_path, f"bad config.json: {exc}") from None
