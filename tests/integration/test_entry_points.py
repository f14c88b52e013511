"""Entry points: ``python -m kvsidecar.sidecar`` (what ``SidecarProcess`` starts), the console scripts of
pyproject.toml, the read-only inspector, and a child that must run *this* kvsidecar even where
the working directory or PYTHONPATH hold another ``sidecar`` or ``kvsidecar``.  (The installed
wheel, its one top-level package and SGLang's entry point in a fresh venv: test_packaging.py.)"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvsidecar.connector.client import SidecarClient
from kvsidecar.sidecar import spawn
from kvsidecar.sidecar.spawn import SidecarProcess, SidecarStartError, child_env, launcher_argv

from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_console_scripts_resolve_to_mains():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kvsidecar-launch": "kvsidecar.sidecar.app:main", "kvsidecar-inspect": "kvsidecar.sidecar.inspector:main"}
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target


def test_python_m_sidecar_is_the_launcher(tmp_path):
    assert launcher_argv() == [sys.executable, "-m", "kvsidecar.sidecar"]
    r = subprocess.run(launcher_argv() + ["--help"], capture_output=True, text=True, timeout=60,
                       env=child_env(cwd=str(tmp_path)), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--instance" in r.stdout and "--ready-fd" in r.stdout
    # an unusable configuration is an exit code, not a traceback
    r = subprocess.run(launcher_argv() + ["--set", "no-equals-sign"], capture_output=True, text=True, timeout=60,
                       env=child_env(cwd=str(tmp_path)), cwd=tmp_path)
    assert r.returncode != 0 and "KEY=VALUE" in r.stderr


def _published(instance, pings, timeout_s=20.0) -> dict:
    """The inspector's snapshot once the published stats count ``pings`` pings (stats are published
    at most every stats_interval_ms, after the sidecar did some work)."""
    from kvsidecar.sidecar import inspector

    snap = wait_until(lambda: inspector.snapshot(instance), timeout_s, f"{pings} pings in the published stats",
                      until=lambda snap: snap["stats"].get("counters", {}).get("op_ping", 0) >= pings)
    assert snap["stats"]["counters"]["op_ping"] == pings, snap["stats"]
    return snap


def test_inspector_reads_without_sending_a_request(sidecar, instance):
    from kvsidecar.sidecar import inspector

    c = SidecarClient(instance, group="g", rank=0, group_size=1)
    c.attach()
    try:
        for _ in range(3):
            c.call("ping", payload=b"x")
        before = _published(instance, 3)
        assert before["sidecar"]["alive"] and before["sidecar"]["pid"] == sidecar.pid
        assert len(before["clients"]) == 1  # the client's; the inspector holds none
        # the module (as ``python -m kvsidecar.sidecar.inspector`` and the console script run it) and the wrapper
        r = subprocess.run([sys.executable, "-m", "kvsidecar.sidecar.inspector", "--instance", instance, "--json"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["sidecar"]["pid"] == sidecar.pid
        r = subprocess.run([sys.executable, "-m", "scripts.inspect_shm", "--instance", instance],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0 and f"sidecar {instance}" in r.stdout, r.stderr
        for _ in range(3):
            assert inspector.main(["--instance", instance, "--json"]) == 0
        c.call("ping", payload=b"y")  # one more request, so the stats are published again
        after = _published(instance, 4)
        assert after["stats"]["counters"]["requests"] == before["stats"]["counters"]["requests"] + 1
        mine = [cl for cl in after["stats"]["clients"] if cl["group"] == "g"]
        assert len(mine) == 1 and mine[0]["requests"] == 1 + 4  # its attach and its four pings
        assert len(after["clients"]) == 1
    finally:
        c.detach()


def test_inspector_without_sidecar_exits_1(instance, capsys):
    from kvsidecar.sidecar import inspector

    assert inspector.main(["--instance", instance]) == 1
    assert "no sidecar" in capsys.readouterr().err


def _imported_by_child(env, cwd) -> Path:
    """The ``kvsidecar.sidecar`` package directory a child started with ``env`` in ``cwd`` imports."""
    r = subprocess.run([sys.executable, "-c", "import kvsidecar.sidecar as s, sys; sys.stdout.write(s.__file__)"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout).resolve().parent


def _decoy(root: Path, dotted: str) -> Path:
    """A package ``dotted`` under ``root`` whose ``__main__`` exits with a message; its parents are
    namespace portions, as in another kvsidecar's build tree or site-packages."""
    pkg = root.joinpath(*dotted.split("."))
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(f"raise SystemExit('decoy {dotted}')\n")
    return root


def test_child_runs_this_package_from_anywhere(instance, tmp_path, monkeypatch):
    """From another directory, and beside a top-level ``sidecar`` package of someone else's (PyPI's
    JupyterLab widget of that name installs one) first on PYTHONPATH: the child runs this
    kvsidecar with the environment as it is, and the sidecar starts."""
    assert _imported_by_child(child_env(cwd=str(tmp_path)), tmp_path) == spawn._PACKAGE_DIR
    env = dict(os.environ, PYTHONPATH=str(_decoy(tmp_path / "other", "sidecar")))
    monkeypatch.chdir(tmp_path)
    assert child_env(env) is env  # nothing to fix: the name is kvsidecar.sidecar now
    with SidecarProcess(instance, overrides={"l3.backend": "none", "pool.num_blocks": 16}, env=env) as sp:
        assert sp.proc.poll() is None
    r = subprocess.run([sys.executable, "-c", "import sidecar, kvsidecar.sidecar"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # both import side by side in one process


def test_child_beside_another_kvsidecar(instance, tmp_path, monkeypatch):
    """Another ``kvsidecar.sidecar`` first on the child's PYTHONPATH: a wheel-installed kvsidecar goes
    in front of it (the child's PYTHONPATH only); an editable install (an import hook, no directory
    to put first) is a SidecarStartError naming both, never a child running the other one."""
    env = dict(os.environ, PYTHONPATH=str(_decoy(tmp_path / "other", "kvsidecar.sidecar")))
    monkeypatch.chdir(tmp_path)
    assert _imported_by_child(env, tmp_path) == tmp_path / "other" / "kvsidecar" / "sidecar"
    if spawn._import_root() is None:  # editable
        with pytest.raises(SidecarStartError, match="editable"):
            SidecarProcess(instance, overrides={"l3.backend": "none", "pool.num_blocks": 16}, env=env)
        return
    fixed = child_env(env)
    assert fixed["PYTHONPATH"].split(os.pathsep) == [str(spawn._import_root()), str(tmp_path / "other")]
    assert os.environ.get("PYTHONPATH") != fixed["PYTHONPATH"]  # only the child's environment
    assert _imported_by_child(fixed, tmp_path) == spawn._PACKAGE_DIR
    with SidecarProcess(instance, overrides={"l3.backend": "none", "pool.num_blocks": 16}, env=env) as sp:
        assert sp.proc.poll() is None
