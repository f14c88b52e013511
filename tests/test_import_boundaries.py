"""The import graph of the one package, ``kvsidecar``, read from the source (ast; Cython by its
import lines), including imports inside functions:

* ``kvsidecar.sidecar`` and ``kvsidecar.connector`` never import each other (``shm`` is their
  only contract); ``kvsidecar.shm`` imports neither; ``kvsidecar._native`` imports nothing of the
  project;
* nothing in the package imports ``scripts`` or ``tests`` (they are not installed);
* nothing anywhere in the repository imports the parts under their folder names (``sidecar``,
  ``shm``, ``connector``, ``native``): from the repo root those would import a second copy.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"sidecar": "kvsidecar.sidecar", "shm": "kvsidecar.shm", "connector": "kvsidecar.connector",
         "native": "kvsidecar._native"}
# part -> the parts of the project it must not import
FORBIDDEN = {
    "kvsidecar.sidecar": ("kvsidecar.connector",),
    "kvsidecar.connector": ("kvsidecar.sidecar",),
    "kvsidecar.shm": ("kvsidecar.sidecar", "kvsidecar.connector"),
    "kvsidecar._native": ("kvsidecar.sidecar", "kvsidecar.connector", "kvsidecar.shm"),
}
OUTSIDE = ("scripts", "tests")
_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import|c?import\s+([\w.]+))", re.M)


def module_name(path: Path) -> str:
    """The dotted name a file of the repository is imported as."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in PARTS:
        return ".".join([PARTS[parts[0]]] + parts[1:])
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False, cython: bool = False) -> set[str]:
    """Absolute names imported by ``module``'s source (relative imports resolved)."""
    if cython:
        return {a or b for a, b in _CYTHON_IMPORT.findall(source)}
    out = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
    return out


def violations(module: str, imported: set[str]) -> list[str]:
    """What ``module`` (a dotted name) must not import among ``imported``."""
    bad = []
    for name in sorted(imported):
        head = name.split(".")[0]
        if head in PARTS:
            bad.append(f"{module} imports {name} (the folder name; the package is {PARTS[head]})")
        if module.startswith("kvsidecar.") and head in OUTSIDE:
            bad.append(f"{module} imports {name} (not installed)")
        for part, forbidden in FORBIDDEN.items():
            if module == part or module.startswith(part + "."):
                bad.extend(f"{module} imports {name} ({part} must not import {f})" for f in forbidden
                           if name == f or name.startswith(f + "."))
    return bad


def _sources():
    for folder in [*PARTS, *OUTSIDE]:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".pyx") and "__pycache__" not in path.parts:
                yield path


def test_the_import_graph_keeps_the_boundaries():
    seen = {p: module_name(p) for p in _sources()}
    assert {"kvsidecar.sidecar.app", "kvsidecar.connector.client", "kvsidecar.shm.protocol",
            "kvsidecar._native.hashing", "scripts.demo", "tests.conftest"} <= set(seen.values())
    bad = []
    for path, module in seen.items():
        imported = imports_of(path.read_text(), module, is_package=path.stem == "__init__",
                              cython=path.suffix == ".pyx")
        bad += violations(module, imported)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, source, expect", [
    ("kvsidecar.sidecar.kv.ops", "from kvsidecar.connector.client import SidecarClient", "must not import"),
    ("kvsidecar.connector.adapter", "def f():\n    from kvsidecar.sidecar import spawn", "must not import"),
    ("kvsidecar.connector.adapter", "from ..sidecar.config import X", "must not import"),
    ("kvsidecar.shm.ring", "import kvsidecar.sidecar.app as a", "must not import"),
    ("kvsidecar.shm.ring", "from kvsidecar import connector", "must not import"),
    # (spelled so that no rewrite of the folder names ever touches them)
    ("kvsidecar.shm.ring", "from %s.errors import X" % "shm", "the folder name"),
    ("tests.test_x", "import %s.atomics as a" % "native", "the folder name"),
    ("kvsidecar.connector.client", "from scripts import simulate", "not installed"),
])
def test_the_checker_catches(module, source, expect):
    bad = violations(module, imports_of(source, module))
    assert bad and expect in bad[0], bad


def test_the_checker_allows_the_contract():
    assert not violations("kvsidecar.sidecar.app", imports_of(
        "from kvsidecar.shm import protocol\nfrom kvsidecar._native.hashing import x\nfrom . import spawn",
        "kvsidecar.sidecar.app"))
    assert not violations("kvsidecar.shm.ring", imports_of("from kvsidecar._native import atomics", "kvsidecar.shm.ring"))
    assert not violations("tests.test_x", imports_of("from kvsidecar.sidecar.spawn import SidecarProcess\n"
                                                     "from kvsidecar.connector.client import C", "tests.test_x"))
