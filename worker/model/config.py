"""Model architecture config: the one shape description the worker builds a model from.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` dict, in both the
transformers 5 spelling (`rope_parameters`) and the older one (top-level `rope_theta`,
`rope_scaling`), for the Llama family: llama (Llama 2/3, SmolLM2), mistral, qwen2.
Anything the worker's model cannot run exactly raises `ModelLoadError` here, at load
time, rather than producing different tokens later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
# transformers' per-class defaults, used only when config.json leaves the key out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}


class ModelLoadError(ValueError):
    """A model name, directory, file or config that kvmesh cannot load; the message says why."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Non-default RoPE frequency scaling (HF `rope_parameters` / `rope_scaling`).

    `rope_type` is "linear" (positions divided by `factor`) or "llama3" (the Llama 3.1
    band-wise rescale, which also uses the low/high frequency factors and the
    pretraining context `original_max_position_embeddings`).
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"rope_type={self.rope_type!r}: expected 'linear' or 'llama3'")
        if not self.factor > 0:
            raise ValueError(f"factor={self.factor!r}: must be > 0")
        if self.rope_type == "llama3":
            for field in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                value = getattr(self, field)
                if value is None or not value > 0:
                    raise ValueError(f"{field}={value!r}: llama3 rope scaling needs a positive value")
            assert self.high_freq_factor is not None and self.low_freq_factor is not None
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"high_freq_factor={self.high_freq_factor!r}: must exceed "
                    f"low_freq_factor={self.low_freq_factor!r}"
                )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one Llama-family decoder.

    `attention_bias` means the q/k/v projections carry a bias (o_proj never does);
    `sliding_window` is the attention window of every layer, or None for full attention;
    `eos_token_ids` merges config.json's and generation_config.json's end-of-sequence ids.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r}: expected one of {SUPPORTED_MODEL_TYPES}")
        for field in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}={value!r}: must be a positive int")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r}: must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r}: must be > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window!r}: must be positive or None")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids={self.eos_token_ids!r}: ids must be >= 0")
        if self.bos_token_id is not None and self.bos_token_id < 0:
            raise ValueError(f"bos_token_id={self.bos_token_id!r}: must be >= 0 or None")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(
        cls,
        d: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> ModelConfig:
        """Build from a parsed HF `config.json` (and optional `generation_config.json`).

        Raises `ModelLoadError` for unsupported architectures or options (another
        model_type, a non-SiLU activation, Llama o_proj/MLP biases, RoPE types other than
        default/linear/llama3, Qwen2 windows on only some layers) and for missing or
        invalid fields. `name` defaults to the basename of `_name_or_path`, else model_type.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}: kvmesh runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hidden_act!r}: kvmesh's MLP is SwiGLU (silu)")
        if model_type == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
            raise ModelLoadError("llama with attention_bias/mlp_bias (o_proj or MLP biases) is not supported")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"partial_rotary_factor={d['partial_rotary_factor']!r} is not supported")

        try:
            num_heads = int(_required(d, "num_attention_heads"))
            hidden_size = int(_required(d, "hidden_size"))
            num_layers = int(_required(d, "num_hidden_layers"))
            max_positions = int(d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type])
            rope_theta, rope_scaling = _parse_rope(d, max_positions)
            head_dim = d.get("head_dim") or hidden_size // num_heads
            return cls(
                model_type=model_type,
                vocab_size=int(_required(d, "vocab_size")),
                hidden_size=hidden_size,
                intermediate_size=int(_required(d, "intermediate_size")),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(d.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                sliding_window=_parse_sliding_window(d, model_type, num_layers),
                bos_token_id=_parse_bos(d, generation_config),
                eos_token_ids=_merge_eos(d, generation_config),
                name=name or _display_name(d, model_type),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"invalid {model_type} config: {e}") from e


def _required(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ModelLoadError(f"config.json lacks required field {key!r}")
    return d[key]


def _parse_rope(d: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    # Same precedence as transformers 5: an old `rope_scaling` dict, else `rope_parameters`;
    # values inside the dict win over top-level keys.
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ModelLoadError(f"rope parameters must be a dict, got {rope!r}")
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        raise ModelLoadError("per-layer-type rope_parameters are not supported")
    theta = float(rope.get("rope_theta") or d.get("rope_theta") or _DEFAULT_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r}: kvmesh supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    original = rope.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        original = max_positions
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(_required(rope, "factor")),
        low_freq_factor=_opt_float(rope.get("low_freq_factor")),
        high_freq_factor=_opt_float(rope.get("high_freq_factor")),
        original_max_position_embeddings=None if original is None else int(original),
    )
    return theta, scaling


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _parse_sliding_window(d: Mapping[str, Any], model_type: str, num_layers: int) -> int | None:
    window = d.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    if model_type == "mistral":
        return int(window)
    # qwen2: the window applies only with use_sliding_window, and then only to layers
    # from max_window_layers on (or as listed in layer_types).
    if not d.get("use_sliding_window", False):
        return None
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = int(d.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise ModelLoadError("qwen2 with sliding windows on only some layers is not supported")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _merge_eos(d: Mapping[str, Any], gen: Mapping[str, Any] | None) -> tuple[int, ...]:
    merged: list[int] = []
    for token_id in _ids(d.get("eos_token_id")) + _ids((gen or {}).get("eos_token_id")):
        if token_id not in merged:
            merged.append(token_id)
    return tuple(merged)


def _parse_bos(d: Mapping[str, Any], gen: Mapping[str, Any] | None) -> int | None:
    bos = d.get("bos_token_id")
    if bos is None and gen is not None:
        bos = gen.get("bos_token_id")
    return None if bos is None else int(bos)


def _display_name(d: Mapping[str, Any], model_type: str) -> str:
    path = str(d.get("_name_or_path") or "").rstrip("/\\")
    return path.replace("\\", "/").rsplit("/", 1)[-1] or model_type
