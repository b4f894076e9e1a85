"""The tokenizer files as they travel: read, digest, load from bytes.

Oracles: the digest against an independent encoding of its spec (struct), `from_files` against
`from_model_dir` on SmolLM2's real files.
"""
from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path

import pytest

from contracts.tokenizer import (
    MAX_TOKENIZER_BYTES,
    TOKENIZER_FILES,
    ModelTokenizer,
    TokenizerError,
    TokenizerFilesTooLarge,
    read_tokenizer_files,
    tokenizer_files_digest,
)

TEXTS = ("The capital of France is", "  spaces\tand\nnewlines  ", "émoji 🚀 and 中文", "")
CHATS = ([{"role": "user", "content": "Name three primary colors."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}])


def spec_digest(files: dict[str, bytes]) -> str:
    """The digest as the router and the worker agreed on it, written independently."""
    h = hashlib.sha256()
    for name in sorted(files):
        raw = name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + struct.pack("<Q", len(files[name])) + files[name])
    return h.hexdigest()


def test_digest_follows_the_agreed_encoding() -> None:
    files = {"tokenizer.json": b'{"a": 1}', "chat_template.jinja": b"{{ x }}", "tokenizer_config.json": b""}
    assert tokenizer_files_digest(files) == spec_digest(files)
    assert tokenizer_files_digest(dict(reversed(list(files.items())))) == spec_digest(files)   # order-free
    assert tokenizer_files_digest({}) == hashlib.sha256(b"").hexdigest()
    # the lengths keep names and bytes apart
    assert tokenizer_files_digest({"ab": b"c"}) != tokenizer_files_digest({"a": b"bc"})
    assert tokenizer_files_digest(files) != tokenizer_files_digest(files | {"tokenizer.json": b'{"a": 2}'})


def test_read_files_of_smollm2_and_load_them_alike(smollm2_dir: Path) -> None:
    files = read_tokenizer_files(smollm2_dir)
    assert set(files) == {n for n in TOKENIZER_FILES if (smollm2_dir / n).is_file()} and "tokenizer.json" in files
    assert all(files[n] == (smollm2_dir / n).read_bytes() for n in files)
    local, sent = ModelTokenizer.from_model_dir(smollm2_dir), ModelTokenizer.from_files(files)
    assert sent.chat_template == local.chat_template and sent.chat_template
    assert sent.special_tokens == local.special_tokens
    for text in TEXTS:
        assert sent.encode(text) == local.encode(text)
        assert sent.decode(local.encode(text)) == local.decode(local.encode(text))
    for chat in CHATS:
        assert sent.apply_chat_template(chat) == local.apply_chat_template(chat)


def test_template_file_newlines_as_read_text(smollm2_dir: Path, tmp_path: Path) -> None:
    """chat_template.jinja with CRLF: bytes loaded as `Path.read_text` reads the file."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_bytes(b"{% for m in messages %}[{{ m.content }}]\r\n{% endfor %}\rend")
    files = read_tokenizer_files(tmp_path)
    assert ModelTokenizer.from_files(files).chat_template == ModelTokenizer.from_model_dir(tmp_path).chat_template
    assert "\r" not in (ModelTokenizer.from_files(files).chat_template or "")


def test_bad_file_sets_are_refused(smollm2_dir: Path, tmp_path: Path) -> None:
    files = read_tokenizer_files(smollm2_dir)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ModelTokenizer.from_files({k: v for k, v in files.items() if k != "tokenizer.json"})
    with pytest.raises(TokenizerError, match="unexpected files"):
        ModelTokenizer.from_files(files | {"../evil.json": b"{}"})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ModelTokenizer.from_files(files | {"tokenizer.json": b"not json"})
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        ModelTokenizer.from_files(files | {"tokenizer_config.json": b"{broken"})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        read_tokenizer_files(tmp_path)                   # an empty dir


def test_size_bound_is_checked_before_reading(smollm2_dir: Path) -> None:
    total = sum((smollm2_dir / n).stat().st_size for n in read_tokenizer_files(smollm2_dir))
    assert total < MAX_TOKENIZER_BYTES
    assert read_tokenizer_files(smollm2_dir, max_bytes=total)
    with pytest.raises(TokenizerFilesTooLarge, match=f"{total} bytes, more than the {total - 1}"):
        read_tokenizer_files(smollm2_dir, max_bytes=total - 1)
    assert read_tokenizer_files(smollm2_dir, max_bytes=None) == read_tokenizer_files(smollm2_dir)
