"""The layering of the packages (kvmesh -> router | worker -> kvstore -> contracts -> proto; router and
worker siblings that never import each other; the router and the contracts torch-free) holds, checked
by import-linter with the contracts in pyproject.toml, which allow no exemptions.

import-linter reads every import statement, those inside functions included, and follows
chains (router -> kvstore -> torch breaks "router imports no torch" too).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmesh", "router", "worker", "kvstore", "contracts", "proto")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(root)}   # the packages under `root`, not the installed ones
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_import_contracts_hold() -> None:
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_wrong_way_import_breaks_the_contracts(tmp_path: Path) -> None:
    """The oracle that the check can fail: the same tree plus one worker -> router import (siblings)."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    scratch = tmp_path / "worker" / "scratch_wrong_way.py"
    scratch.write_text("from router.routing import policy  # a sibling import\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "worker.scratch_wrong_way -> router.routing.policy" in r.stdout, r.stdout
