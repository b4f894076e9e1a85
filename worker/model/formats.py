"""A checkpoint's weights in the format the engine runs them: `weight_dtype`.

`auto` keeps the checkpoint's own format: a GGUF's tensors as they are stored (the default
model: Q4_1 layers, a Q8_0 embedding that is also the tied LM head), an HF dir's linear weights
as bf16 when its safetensors hold bf16, else fp32. `fp32`, `bf16`, `q8_0`, `q4_0`, `q4_1` put
every linear weight and the embedding in that format: a GGUF tensor already in it is kept as
stored, any other is dequantized and quantized again (ggml's reference quantizers); an HF dir
is quantized at load. Norm weights and biases stay fp32.

GGUF tensors are read with the `gguf` package (raw block bytes, no dequantization) and renamed to
the HF names; q and k rows are put back in HF order (llama.cpp's converter permutes them for its
RoPE layout; a row permutation of a quantized weight is exact).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch

from worker.model.config import ModelConfig, ModelLoadError
from worker.model.weights import (
    WEIGHT_DTYPES,
    Bf16Weight,
    QuantRows,
    Weight,
    WeightFormat,
    dense,
    format_of,
    from_gguf_blocks,
    quantize,
    weight_bytes,
    weight_shape,
)

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def parse_weight_dtype(name: str) -> WeightFormat | None:
    """`auto` -> None, else the format; raises ValueError naming the accepted values."""
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype={name!r}; accepted: {', '.join(WEIGHT_DTYPES)}")
    return None if name == "auto" else WeightFormat(name)


def is_format_weight(name: str) -> bool:
    """The tensors `weight_dtype` applies to: every linear weight and the embedding (+ LM head)."""
    return name.endswith("proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP[parts[0]]}.{parts[1]}"


def _hf_row_order(n: int, heads: int) -> torch.Tensor:
    """Row i of the HF weight is row order[i] of llama.cpp's permuted one (transformers'
    reverse permutation: [heads, 2, n / heads / 2] -> [heads, n / heads / 2, 2])."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def read_gguf(path: Path, config: ModelConfig) -> dict[str, Weight]:
    """Every tensor of a Llama-family GGUF under its HF name: Q8_0 / Q4_0 / Q4_1 as `QuantRows`,
    F32 / F16 / BF16 as fp32 tensors. Raises ModelLoadError for other tensor types."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    quant = {gguf.GGMLQuantizationType.Q8_0: WeightFormat.Q8_0, gguf.GGMLQuantizationType.Q4_0: WeightFormat.Q4_0,
             gguf.GGMLQuantizationType.Q4_1: WeightFormat.Q4_1}
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        k = int(t.shape[0])
        w: Weight
        if t.tensor_type in quant:
            w = from_gguf_blocks(quant[t.tensor_type], torch.from_numpy(t.data.copy()), k)
        elif t.tensor_type.name in ("F32", "F16"):
            w = torch.from_numpy(t.data.copy()).float()
        elif t.tensor_type.name == "BF16":
            w = torch.from_numpy(t.data.copy()).view(torch.bfloat16).float()
        else:
            raise ModelLoadError(f"{path}: tensor {t.name} is {t.tensor_type.name}; kvmesh reads "
                                 "F32, F16, BF16, Q8_0, Q4_0 and Q4_1")
        for part, heads in ((".self_attn.q_proj.", config.num_heads), (".self_attn.k_proj.", config.num_kv_heads)):
            if part in name:
                rows = _hf_row_order(weight_shape(w)[0], heads)
                w = w.take_rows(rows) if isinstance(w, QuantRows) else w[rows]
        out[name] = w
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def in_format(name: str, w: Weight, fmt: WeightFormat | None) -> Weight:
    """`w` in `fmt` (None: as it is) if `name` is one `weight_dtype` applies to."""
    if fmt is None or not is_format_weight(name) or format_of(w) is fmt:
        return w
    if fmt is WeightFormat.FP32:
        return dense(w)
    if fmt is WeightFormat.BF16:
        return Bf16Weight(dense(w, torch.bfloat16))
    if weight_shape(w)[1] % 32:
        raise ModelLoadError(f"{name}: weight_dtype={fmt.value} needs an input size that is a multiple of 32, "
                             f"not {weight_shape(w)[1]}")
    return quantize(dense(w), fmt)


def own_format(weights: Mapping[str, Weight]) -> WeightFormat:
    """An HF dir's own format: bf16 when its linear weights are stored as bf16, else fp32."""
    stored = {w.dtype for n, w in weights.items() if is_format_weight(n) and isinstance(w, torch.Tensor)}
    return WeightFormat.BF16 if stored == {torch.bfloat16} else WeightFormat.FP32


def describe(weights: Mapping[str, Weight]) -> str:
    """The formats of the weights `weight_dtype` applies to, most common first: "q4_1 (210),
    q8_0 (1)"."""
    counts = Counter(format_of(w).value for n, w in weights.items() if is_format_weight(n))
    return ", ".join(f"{f} ({c})" for f, c in counts.most_common())


def total_bytes(weights: Mapping[str, Weight]) -> int:
    """Bytes of every weight in its format (norms and biases fp32)."""
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else weight_bytes(w)
               for w in weights.values())


CACHE_VERSION = 1


def cache_path(model_dir: Path, weight_dtype: str, source: Path) -> Path:
    """Where `weight_dtype`'s weights of `model_dir` are cached: keyed by the dir, the format and
    the source file's size and mtime (a GGUF, or the dir's first safetensors shard)."""
    import hashlib

    from contracts.models import cache_root

    st = source.stat()
    key = f"v{CACHE_VERSION}\0{model_dir.resolve()}\0{weight_dtype}\0{source}\0{st.st_size}\0{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "weights" / f"{model_dir.name}-{weight_dtype}-{digest}.safetensors"


def save_cached(path: Path, weights: Mapping[str, Weight]) -> None:
    """Write `weights` (any formats) as one safetensors file, atomically (a temp file renamed)."""
    import os
    import tempfile

    import safetensors.torch

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, w in weights.items():
        if isinstance(w, QuantRows):
            tensors |= {f"{name}:q": w.q, f"{name}:d": w.d}
            if w.m is not None:
                tensors[f"{name}:m"] = w.m
            kinds[name] = w.fmt.value
        elif isinstance(w, Bf16Weight):
            tensors[f"{name}:bf16"], kinds[name] = w.t, "bf16"
        else:
            tensors[name], kinds[name] = w, "dense"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=kinds)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_cached(path: Path) -> dict[str, Weight] | None:
    """The weights `save_cached` wrote, or None when there is no readable file."""
    import safetensors
    import safetensors.torch

    try:
        with safetensors.safe_open(str(path), "pt") as f:
            kinds = f.metadata() or {}
        tensors = safetensors.torch.load_file(str(path))
    except (OSError, safetensors.SafetensorError):
        return None
    out: dict[str, Weight] = {}
    for name, kind in kinds.items():
        if kind == "dense":
            out[name] = tensors[name]
        elif kind == "bf16":
            out[name] = Bf16Weight(tensors[f"{name}:bf16"])
        else:
            out[name] = QuantRows(WeightFormat(kind), tensors[f"{name}:q"], tensors[f"{name}:d"],
                                  tensors.get(f"{name}:m"))
    return out
