"""The layering of the packages (kvmesh -> router | worker -> kvstore -> contracts -> proto; router and
worker siblings that never import each other; the router and the contracts torch-free) holds, checked
by import-linter with the contracts in pyproject.toml, which allow no exemptions; and no module takes
part in an import circle.

import-linter and grimp (its graph library) read every import statement, those inside functions and
under `if TYPE_CHECKING:` included; import-linter follows chains (router -> kvstore -> torch breaks
"router imports no torch" too).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmesh", "router", "worker", "kvstore", "contracts", "proto")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(root)}   # the packages under `root`, not the installed ones
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.multiproc
def test_import_contracts_hold() -> None:
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.multiproc
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


def import_graph() -> grimp.ImportGraph:
    """Every import between the modules of PACKAGES, function-level and TYPE_CHECKING imports included."""
    return grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=False)


def import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each is a set
    of modules that reach one another through imports, i.e. one or more import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:   # `module` roots a component: pop it
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)   # depth <= the number of modules (a few hundred)
    return sorted(circles)


def test_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph.modules) > 100   # the packages were found (not an empty graph)
    assert import_circles(graph) == []


def test_a_function_level_import_back_makes_a_circle() -> None:
    """The oracle that the check can fail: the real graph plus one import back along a real chain."""
    graph = import_graph()
    importer = "kvstore.store"
    imported = sorted(graph.find_modules_directly_imported_by(importer) & graph.find_children("kvstore"))[0]
    graph.add_import(importer=imported, imported=importer)
    circles = import_circles(graph)
    assert len(circles) == 1 and {importer, imported} <= set(circles[0]), circles
