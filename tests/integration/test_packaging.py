"""The built wheel: exactly one top-level import package, ``kvsidecar``, holding every module of the
four folders (and the compiled ``kvsidecar._native`` extensions); installed with pip into a
brand-new virtualenv it runs on its own, away from the checkout: the console scripts, SGLang's
``sglang.srt.plugins`` entry point, ``python -m kvsidecar.sidecar`` through ``SidecarProcess``
and a client's round trip.

The wheel is built from a copy of the repository's files (what a clean clone holds), with this
interpreter's pinned build requirements (no index).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"sidecar": "sidecar", "shm": "shm", "connector": "connector", "native": "_native"}
EXTENSIONS = ("atomics", "hashing", "copy", "blockindex")


def _repo_files() -> list[str]:
    """The files a clean clone holds (tracked, plus new ones git does not ignore)."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                       timeout=60)
    if r.returncode != 0:
        pytest.skip(f"not a git checkout: {r.stderr.decode().strip()}")
    return [f for f in r.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for f in _repo_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-qq", "--no-build-isolation", "--no-deps",
                        "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("kvsidecar-*.whl")
    return whl


def test_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    info = f"kvsidecar-{version}.dist-info"
    assert {n.split("/")[0] for n in names} == {"kvsidecar", info}, sorted({n.split("/")[0] for n in names})
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["kvsidecar"]
    # every Python file of the four folders, under its part's name; nothing else of the repository
    want = {f"kvsidecar/{part}/{p.relative_to(ROOT / folder).as_posix()}"
            for folder, part in FOLDERS.items() for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts}
    have = {n for n in names if n.endswith(".py")}
    assert have == want, (sorted(have - want), sorted(want - have))
    for ext in EXTENSIONS:
        assert [n for n in names if n.startswith(f"kvsidecar/_native/{ext}.") and n.endswith(".so")], ext
    assert not [n for n in names if n.endswith((".pyx", ".c"))]


PROBE = r"""
import importlib, importlib.util, json, site, sys
from importlib.metadata import entry_points
from pathlib import Path

site_dir = Path(site.getsitepackages()[0]).resolve()
out = {"site": str(site_dir)}
out["modules"] = {m: str(Path(importlib.import_module(m).__file__).resolve().relative_to(site_dir))
                  for m in ("kvsidecar.sidecar.app", "kvsidecar.sidecar.inspector", "kvsidecar.connector.client",
                            "kvsidecar.shm.protocol", "kvsidecar._native.hashing")}
out["plugin_origin"] = str(Path(importlib.util.find_spec("kvsidecar.connector.sglang_plugin").origin).resolve())
out["folder_names"] = {n: importlib.util.find_spec(n) is not None for n in ("sidecar", "shm", "connector", "native")}
out["eps"] = {g: {e.name: [e.value, e.dist.name] for e in entry_points(group=g) if e.dist.name == "kvsidecar"}
              for g in ("console_scripts", "sglang.srt.plugins")}

from kvsidecar.connector.client import SidecarClient
from kvsidecar.sidecar.spawn import SidecarProcess

instance = sys.argv[1]
with SidecarProcess(instance, overrides={"l3.backend": "none", "pool.num_blocks": 16}) as sp:
    c = SidecarClient(instance, group="g", rank=0, group_size=1)
    c.attach()
    out["pong"] = c.call("ping", payload=b"wheel")["payload"].decode()
    c.detach()
    out["exit"] = sp.stop()
print(json.dumps(out))
"""


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path, instance):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-qq", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # kvsidecar's runtime dependencies, taken from this interpreter (only those: not its kvsidecar)
    deps = tmp_path / "deps"
    deps.mkdir()
    for name in ("msgpack", "posix_ipc", "prometheus_client"):
        origin = Path(importlib.util.find_spec(name).origin)
        top = origin.parent if origin.name == "__init__.py" else origin
        (deps / top.name).symlink_to(top)
    site_dir = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    (site_dir / "kvsidecar-test-deps.pth").write_text(f"{deps}\n")

    r = subprocess.run([str(py), "-c", PROBE, instance], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["modules"] == {"kvsidecar.sidecar.app": "kvsidecar/sidecar/app.py",
                              "kvsidecar.sidecar.inspector": "kvsidecar/sidecar/inspector.py",
                              "kvsidecar.connector.client": "kvsidecar/connector/client.py",
                              "kvsidecar.shm.protocol": "kvsidecar/shm/protocol.py",
                              "kvsidecar._native.hashing": got["modules"]["kvsidecar._native.hashing"]}
    assert got["modules"]["kvsidecar._native.hashing"].startswith("kvsidecar/_native/hashing.")
    assert got["plugin_origin"] == str(Path(got["site"]) / "kvsidecar" / "connector" / "sglang_plugin.py")
    assert got["folder_names"] == {"sidecar": False, "shm": False, "connector": False, "native": False}
    assert got["eps"] == {
        "console_scripts": {"kvsidecar-launch": ["kvsidecar.sidecar.app:main", "kvsidecar"],
                            "kvsidecar-inspect": ["kvsidecar.sidecar.inspector:main", "kvsidecar"]},
        "sglang.srt.plugins": {"kvsidecar": ["kvsidecar.connector.sglang_plugin:load", "kvsidecar"]},
    }
    assert got["pong"] == "wheel" and got["exit"] == 0
    # the console scripts pip generated run the installed mains
    for script in ("kvsidecar-launch", "kvsidecar-inspect"):
        r = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
        assert r.returncode == 0 and "--instance" in r.stdout, r.stderr
