"""Whether Triton can run here, and how: imported by the backend choice (`backend.py`) and by
the Triton kernels (`triton_common.py`) alike, and importing neither (nor Triton itself)."""
from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels would run in the interpreter (CPU tensors), not compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"
