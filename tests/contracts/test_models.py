"""contracts.models: finding a model's dir without torch. The worker's loader (which converts)
is the oracle for where a converted model lives; the router loads its tokenizer from there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.models import (
    CONVERTED_MARKER,
    ModelLocateError,
    ModelNotPrepared,
    converted_dir,
    find_model_dir,
    locate_model,
)


def test_alias_finds_the_dir_the_loader_converted(smollm2_dir: Path) -> None:
    assert find_model_dir("smollm2") == smollm2_dir
    assert find_model_dir("SmolLM2-135M") == smollm2_dir
    assert (smollm2_dir / CONVERTED_MARKER).is_file()
    assert find_model_dir(str(smollm2_dir)) == smollm2_dir.resolve()   # an HF dir, as is


def test_unconverted_gguf_is_not_prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = locate_model(str(gguf))
    assert source.gguf == gguf.resolve() and source.model_dir == converted_dir(gguf.resolve())
    assert source.model_dir.parent == tmp_path / "cache" / "models"
    with pytest.raises(ModelNotPrepared, match="worker.model.loader prepare"):
        find_model_dir(str(gguf))
    gguf.write_bytes(b"GGUF2")  # a changed file is a different conversion
    os.utime(gguf, ns=(1, 1))
    assert converted_dir(gguf.resolve()) != source.model_dir


@pytest.mark.parametrize("name, match", [
    ("llama-9000", "unknown model"), ("./nope", "does not exist"), ("x.gguf", "does not exist"),
])
def test_bad_names_say_why(name: str, match: str) -> None:
    with pytest.raises(ModelLocateError, match=match):
        find_model_dir(name)


def test_hf_dir_without_weights_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLocateError, match="safetensors"):
        find_model_dir(str(tmp_path))


@pytest.mark.multiproc
def test_router_loads_the_tokenizer_without_torch(smollm2_dir: Path) -> None:
    code = ("import sys; from router.server import _load_tokenizer; "
            "t = _load_tokenizer('smollm2'); assert t.encode('Hello world'), 'no ids'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr


@pytest.mark.multiproc
def test_router_converts_in_a_child_and_reports_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unconverted GGUF makes the router run `python -m worker.model.loader prepare` in a child;
    the child's error (here: not a GGUF) becomes the router's start error on --model."""
    from router.routing.errors import RouterStartError
    from router.server import _load_tokenizer

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(RouterStartError, match="GGUF magic") as e:
        _load_tokenizer(str(gguf))
    assert e.value.field == "model"
    assert not converted_dir(gguf.resolve()).exists()
