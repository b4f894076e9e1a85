"""`kvmesh generate` bad input: exit status 2 and one stderr line that names the flag."""
from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import main

BAD: list[tuple[list[str], str]] = [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--prompt", ""], "--prompt"),
    (["--kv-eviction", "h2o"], "--kv-budget"),
    (["--kv-eviction", "h2o", "--kv-budget", "64", "--h2o-decay", "1.5"], "--h2o-decay"),
    (["--kv-eviction", "h2o", "--kv-budget", "64", "--h2o-decay", "0"], "--h2o-decay"),
    (["--kv-eviction", "streaming", "--kv-budget", "64", "--attention-sinks", "-1"], "--attention-sinks"),
    (["--kv-cache-memory-gib", "0"], "--kv-cache-memory-gib"),
    (["--model", "no-such-model"], "--model"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_generate_bad_input_names_the_flag(extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "smollm2"] + ([] if "--prompt-file" in extra else ["--prompt", "hi"])
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh generate: {flag}") and "\n" not in err, err


def test_generate_unreadable_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmesh generate: --model") and "\n" not in err, err
