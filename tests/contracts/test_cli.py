"""contracts.cli.flagify: a config's ValueError becomes a message naming the CLI flag."""
from __future__ import annotations

import pytest

from contracts.cli import flagify


@pytest.mark.parametrize(("message", "expected"), [
    ("max_tokens=0 must be >= 1", "--max-tokens: max_tokens=0 must be >= 1"),
    ("h2o_decay=1.5 must be in (0, 1]", "--h2o-decay: h2o_decay=1.5 must be in (0, 1]"),
    ("  workers=0 must be >= 1", "--workers:   workers=0 must be >= 1"),
    ("model is empty", "--model: model is empty"),
    ("Redis is down", "Redis is down"),         # not a field name: left as it is
    ("", ""),
])
def test_flagify_names_the_flag(message: str, expected: str) -> None:
    assert flagify(message) == expected
