"""The text the accuracy benches score (`kvmesh bench accuracy`): where it comes from and how an
engine turns it into tokens. Shared by the KV-dtype axis (kvmesh/bench/engine.py) and the
weight-dtype axis (kvmesh/bench/accuracy_weights.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def accuracy_text(path: Path | None = None) -> tuple[str, str, Path]:
    """(text, where it came from in words, its file): `path`, else real English shipped with every
    CPython, its LICENSE.txt (named without this machine's path; llama.cpp's tools read the file)."""
    if path is None:
        import sys
        import sysconfig
        path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
        if not path.exists():  # some distributions drop it: then the Python docs' topic texts (pydoc)
            import pydoc_data
            path = Path(pydoc_data.__file__).parent / "topics.py"
        where = f"the interpreter's {path.name} (Python {sys.version.split()[0]}'s stdlib)"
    else:
        where = str(path)
    try:
        return path.read_text(encoding="utf-8"), where, path
    except (OSError, UnicodeDecodeError) as e:
        from contracts.cli import CLIError
        raise CLIError(f"--text: cannot read {path}: {e}") from None


def encode_text(engine: Any, text: str) -> list[int]:
    """The engine's tokens for `text`; UTF-8 bytes for a tokenizer-less model (test models)."""
    if engine.tokenizer is not None:
        return list(engine.tokenizer.encode(text, add_special_tokens=False))
    if engine.model_config.vocab_size < 256:
        raise ValueError(f"model {engine.cfg.model} has no tokenizer and a vocab under 256")
    return list(text.encode("utf-8"))
