"""Errors of the `kvmesh` command line, shared by the router's and the worker's CLIs.

Torch-free and free of router/worker imports, so every CLI front can take them. Only the
top-level `kvmesh` entry (kvmesh.cli.main) turns a CLIError into exit status 2.
"""
from __future__ import annotations

import re

_FIELD = re.compile(r"\s*([a-z_][a-z0-9_]*)\b")


class CLIError(Exception):
    """One line for the user, naming the flag; the command exits 2."""


def flagify(message: str) -> str:
    """'max_tokens=0 must be …' → '--max-tokens: max_tokens=0 must be …' (the flag a user typed).

    Config dataclasses name the bad field first in their ValueError; CLI flags share the
    field's name with dashes (STYLE.md), so the flag follows from the message."""
    m = _FIELD.match(message)
    return f"--{m.group(1).replace('_', '-')}: {message}" if m else message
