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

ROOT = Path(__file__).resolve().parents[2]
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


# -- block state has one owner: kv/ ----------------------------------------------------------------
# What changes the pool's block state on the prefix index (kvsidecar.sidecar.kv.index.PrefixIndex and
# its native BlockIndex).  Outside sidecar/kv/ the index is read (match, find, resident_ids, counts)
# and changed only through the pool manager, the lease and staging tables (kv/).
INDEX_MUTATORS = {"pin", "unpin", "publish", "stage", "drop_staging", "release_staging", "alloc", "evict",
                  "touch"}


def index_mutations(source: str) -> list[str]:
    """Calls that change block state on an index in ``source``: ``<x>.index.<mutator>(...)``, a
    mutator on a name bound to ``<x>.index`` (``idx = self.index``) or named ``index`` / ``idx``,
    any use of the index's ``native`` table, and importing the native block index."""
    tree = ast.parse(source)
    aliases = {"index", "idx"}
    for node in ast.walk(tree):  # names bound to an index
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "index":
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for t, v in zip(getattr(node.targets[0], "elts", ()), node.value.elts):
                if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == "index":
                    aliases.add(t.id)

    def is_index(expr) -> bool:
        return (isinstance(expr, ast.Attribute) and expr.attr == "index") or \
            (isinstance(expr, ast.Name) and expr.id in aliases)

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in INDEX_MUTATORS and is_index(node.func.value):
            bad.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
        elif isinstance(node, ast.Attribute) and node.attr == "native" and is_index(node.value):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_native.blockindex"):
            bad.append(f"line {node.lineno}: imports {node.module}")
    return bad


def test_no_index_mutation_outside_kv():
    """Every block-state change (FREE/STAGING/RESIDENT, pins) happens in sidecar/kv/: the executor,
    L3 ops, observers and the loop call the pool manager instead."""
    outside = [p for p in sorted((ROOT / "sidecar").rglob("*.py")) if "kv" not in p.relative_to(ROOT / "sidecar").parts]
    assert any(p.name == "executor.py" for p in outside) and any(p.name == "ops.py" for p in outside)
    bad = [f"{p.relative_to(ROOT)} {hit}" for p in outside for hit in index_mutations(p.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source", [
    "self.index.pin(ids)",
    "def f(self):\n    idx = self.index\n    idx.publish(k, b, p)",
    "def f(self):\n    idx, pool = self.index, self.core.pool\n    idx.stage(k, b)",
    "self.core.index.evict(3)",
    "self.core.index.native.publish(k, b, p)",
    "from kvsidecar._native.blockindex import BlockIndex",
])
def test_the_index_checker_catches(source):
    assert index_mutations(source), source


def test_the_index_checker_allows_reads():
    assert not index_mutations("n = self.index.match(chain)\nb = self.core.index.find(k)\n"
                               "ids = self.index.resident_ids(chain, n)\nself.pool.publish(plan, 3)\n"
                               "self.core.leases.new(blocks, ttl_s=1, now=0, kind='x')")
