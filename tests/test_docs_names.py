"""Every code name README.md and docs/*.md cite exists in the tree.

Checked, in backticked spans outside fenced code blocks:
- paths of ours (`router/routing/core.py`, `kvstore/`, `helm/kvmesh/README.md`) and bare source
  file names (`pool.py`, `block_hash.cpp`): the file or directory exists;
- `path.py:Name`, and a path span followed by a name span (`worker/peer/plane.py` `PeerPlane`):
  the name is defined in that file (top level or in one of its classes);
- dotted names under one of our packages (`worker.engine.engine`, `kvstore.keys.block_hashes`):
  the module exists and each further part is defined in it (a class, then its member); a name
  that is not a module may be a Helm value (`worker.drainTimeoutS` in helm/kvmesh/values.yaml);
  `kvmesh.v1.X` is a service or message of the .proto;
- `Class.member` (`Engine.step`, `Worker.SendBlocks`): a class of ours defines the member (or a
  base class of ours does), or a .proto message / service has that field / rpc.
Relative markdown links must point at an existing file. Parsing is `ast` only: nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmesh", "router", "worker", "kvstore", "contracts", "proto", "tests", "scripts")
TOP = ("kvmesh", "router", "worker", "kvstore", "contracts", "proto", "tests", "helm", "docs", "docker", "scripts")
PROTO = ROOT / "proto" / "kvmesh" / "v1" / "kvmesh.proto"
VALUES = ROOT / "helm" / "kvmesh" / "values.yaml"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
PATH_THEN_NAME = re.compile(r"`([\w./-]+\.py)`\s+`(\w+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
FILE = re.compile(r"^[\w-]+\.(py|proto|cpp)$")
PATH_NAME = re.compile(r"^([\w./-]+\.py):(\w+)$")
DOTTED = re.compile(r"^[a-z_]\w*(\.[A-Za-z_]\w*)+$")
EXTENSIONS = {"txt", "md", "json", "yaml", "yml", "toml", "html", "png", "py", "cpp", "proto", "cpu"}
CLASS_MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)$")


class Parsed(NamedTuple):
    top: set[str]  # names defined at the file's top level
    everywhere: set[str]  # every name defined anywhere in it
    classes: dict[str, tuple[set[str], list[str]]]  # class -> (members, base names)
    self_attrs: set[str]  # `self.x = ...` targets anywhere in the file (members of its classes)


class Tree:
    """Our Python files (parsed with ast when a name needs them) and the .proto, read once."""

    def __init__(self) -> None:
        self.texts = {p: p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
        self.class_files: dict[str, list[Path]] = {}
        for path, text in self.texts.items():
            for name in re.findall(r"^[ \t]*class\s+(\w+)", text, re.M):
                self.class_files.setdefault(name, []).append(path)
        self.basenames = {p.name for p in self.texts} | {
            p.name for pkg in PACKAGES for ext in ("proto", "cpp") for p in (ROOT / pkg).rglob(f"*.{ext}")
        }
        self.proto: dict[str, set[str]] = {}
        for name, body in re.findall(
            r"\b(?:message|service|enum)\s+(\w+)\s*\{((?:[^{}]|\{[^{}]*\})*)\}", PROTO.read_text()
        ):
            fields = re.findall(r"^\s*(?:rpc\s+(\w+)|(?:repeated\s+|optional\s+)?[\w.<>, ]+?\s+(\w+)\s*=)", body, re.M)
            self.proto.setdefault(name, set()).update(a or b for a, b in fields)
        self.strings = set(re.findall(r'"(kvmesh\.v1\.\w+)"', (ROOT / "contracts" / "health.py").read_text()))
        self.values = yaml.safe_load(VALUES.read_text())

    @functools.cache  # noqa: B019 - one Tree per test session
    def parsed(self, path: Path) -> Parsed:
        tree = ast.parse(self.texts[path], str(path))
        top = {n for node in tree.body for n in _defined(node)}
        everywhere: set[str] = set()
        classes: dict[str, tuple[set[str], list[str]]] = {}
        self_attrs: set[str] = set()
        for node in ast.walk(tree):  # one pass
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        self_attrs.add(t.attr)
            if isinstance(node, ast.Module):
                continue
            everywhere |= _defined(node)
            if isinstance(node, ast.ClassDef):
                members = {n for child in node.body for n in _defined(child)}
                bases = [
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                ]
                classes[node.name] = (members, bases)
        return Parsed(top, everywhere, classes, self_attrs)

    def is_class(self, name: str) -> bool:
        return name in self.class_files or name in self.proto

    def has_member(self, cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        if member in self.proto.get(cls, set()):
            return True
        for path in self.class_files.get(cls, []):
            parsed = self.parsed(path)
            found = parsed.classes.get(cls)
            if found is None:
                continue
            members, bases = found
            if member in members or member in parsed.self_attrs:
                return True
            if any(self.has_member(b, member, seen | {cls}) for b in bases if b not in seen and b != cls):
                return True
        return False

    def defines(self, path: Path, name: str) -> bool:
        return path in self.texts and name in self.parsed(path).everywhere

    def module(self, parts: list[str]) -> tuple[Path | None, list[str]]:
        """The longest leading run of `parts` that is a module of ours, and the rest."""
        for n in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:n])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path in self.texts:
                    return path, parts[n:]
        return None, parts

    def resolves_dotted(self, name: str) -> bool:
        parts = name.split(".")
        if parts[:2] == ["kvmesh", "v1"] and len(parts) == 3:
            return parts[2] in self.proto or name in self.strings
        path, rest = self.module(parts)
        if path is not None and self._attrs(path, rest):
            return True
        return self._helm_value(parts)

    def _attrs(self, path: Path, rest: list[str]) -> bool:
        if not rest:
            return True
        p = self.parsed(path)
        if rest[0] not in p.top or len(rest) > 2:
            return False
        return len(rest) == 1 or self.has_member(rest[0], rest[1])

    def _helm_value(self, parts: list[str]) -> bool:
        node = self.values
        for p in parts:
            if not isinstance(node, dict) or p not in node:
                return False
            node = node[p]
        return True


def _defined(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.If, ast.Try)):  # names defined under a guard at top level
        return {n for child in ast.iter_child_nodes(node) for n in _defined(child)}
    return set()


@functools.lru_cache(maxsize=1)
def tree() -> Tree:
    return Tree()


def unresolved(text: str, where: Path) -> list[str]:
    """The names and links in markdown `text` (a file in directory `where`) that do not exist."""
    t = tree()
    text = FENCE.sub("", text)
    bad: list[str] = []
    for m in PATH_THEN_NAME.finditer(text):
        path = ROOT / m.group(1)
        if path in t.texts and not t.defines(path, m.group(2)):
            bad.append(f"{m.group(1)} {m.group(2)}")
    for span in SPAN.findall(text):
        span = span.strip().split("(")[0].rstrip(".,;:")
        if not span or " " in span:
            continue
        if m := PATH_NAME.match(span):
            if not t.defines(ROOT / m.group(1), m.group(2)):
                bad.append(span)
        elif PATH.match(span) and "/" in span and span.split("/")[0] in TOP:
            if not (ROOT / span).exists():
                bad.append(span)
        elif FILE.match(span):
            if span not in t.basenames:
                bad.append(span)
        elif DOTTED.match(span) and span.split(".")[0] in PACKAGES:
            if not t.resolves_dotted(span):
                bad.append(span)
        elif (m := CLASS_MEMBER.match(span)) and m.group(2) not in EXTENSIONS:
            if not (t.is_class(m.group(1)) and t.has_member(m.group(1), m.group(2))):
                bad.append(span)
    for link in LINK.findall(text):
        target = link.split("#")[0]
        if target and not re.match(r"^[a-z]+:", target) and not (where / target).exists():
            bad.append(f"link {link}")
    return bad


DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_name_a_doc_cites_exists(doc: Path) -> None:
    assert unresolved(doc.read_text(), doc.parent) == []


def test_a_wrong_name_is_reported() -> None:
    text = """
Real: `router/routing/core.py`, `kvstore/`, `pool.py`, `kvstore/store.py:KVStore`, `worker.engine.engine`,
`kvstore.keys.block_hashes`, `Engine.step`, `KVStore.lookup`, `Worker.SendBlocks`, `GenerateRequest.cache_salt`,
`worker.drainTimeoutS`, `kvmesh.v1.Router`, `worker/peer/plane.py` `PeerPlane`, [the layout](docs/ARCHITECTURE.md).
Made up: `router/routing/nowhere.py`, `kvstore/store.py:NoSuchThing`, `worker.engine.nothing`,
`Engine.no_such_method`, `worker/server/service.py` `_ask_peer`, `NoSuchClass.method`, `nothere.py`,
[a dead link](docs/missing.md).

```
`worker/in/a/fence.py` is not checked
```
"""
    assert unresolved(text, ROOT) == [
        "worker/server/service.py _ask_peer",
        "router/routing/nowhere.py",
        "kvstore/store.py:NoSuchThing",
        "worker.engine.nothing",
        "Engine.no_such_method",
        "NoSuchClass.method",
        "nothere.py",
        "link docs/missing.md",
    ]
