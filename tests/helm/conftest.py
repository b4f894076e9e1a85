"""The `helm` fixture shared by the chart tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.manifests import HELM


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary under .tools/bin (scripts/install-helm.sh; `make setup` installs it)."""
    if not (HELM.is_file() and HELM.stat().st_mode & 0o111):
        pytest.fail(f"{HELM} is missing: run scripts/install-helm.sh (make setup does)", pytrace=False)
    return HELM
