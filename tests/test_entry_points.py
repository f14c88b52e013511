"""Entry points: ``python -m kvsidecar.sidecar`` (what ``SidecarProcess`` starts), the console scripts of
pyproject.toml, the read-only inspector, and a child that must run *this* package even where
the working directory or PYTHONPATH would give it another one."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from kvsidecar.connector.client import SidecarClient
from kvsidecar.sidecar import spawn
from kvsidecar.sidecar.spawn import SidecarProcess, child_env, launcher_argv

ROOT = Path(__file__).resolve().parent.parent


def test_console_scripts_resolve_to_mains():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kvsidecar-launch": "kvsidecar.sidecar.app:main", "kvsidecar-inspect": "kvsidecar.sidecar.inspector:main"}
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {"sidecar", "kvsidecar.sidecar.l3", "shm", "connector", "native"} <= set(packages)


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

    deadline = time.monotonic() + timeout_s
    while True:
        snap = inspector.snapshot(instance)
        seen = snap["stats"].get("counters", {}).get("op_ping", 0)
        if seen >= pings:
            assert seen == pings, snap["stats"]
            return snap
        assert time.monotonic() < deadline, snap["stats"]
        time.sleep(0.02)


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
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "inspect_shm.py"), "--instance", instance],
                           capture_output=True, text=True, timeout=60, env=child_env(cwd=str(ROOT / "scripts")))
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
    r = subprocess.run([sys.executable, "-c", "import sidecar, sys; sys.stdout.write(sidecar.__file__)"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout).resolve().parent.parent


def test_child_runs_this_package_from_anywhere(instance, tmp_path, monkeypatch):
    """From another directory (installed or not), and with a PYTHONPATH whose ``sidecar`` is a
    decoy: the child imports this package (its root goes first on the child's PYTHONPATH only
    where needed), and the sidecar starts."""
    assert _imported_by_child(child_env(cwd=str(tmp_path)), tmp_path) == spawn._PACKAGE_ROOT
    decoy = tmp_path / "decoy" / "sidecar"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    (decoy / "__main__.py").write_text("raise SystemExit('decoy sidecar')\n")
    env = dict(os.environ, PYTHONPATH=str(decoy.parent))
    monkeypatch.chdir(tmp_path)
    fixed = child_env(env)
    assert fixed["PYTHONPATH"].split(os.pathsep) == [str(spawn._PACKAGE_ROOT), str(decoy.parent)]
    assert os.environ.get("PYTHONPATH") != fixed["PYTHONPATH"]  # only the child's environment
    with SidecarProcess(instance, overrides={"l3.backend": "none", "pool.num_blocks": 16}, env=env) as sp:
        assert sp.proc.poll() is None


def test_sglang_plugin_entry_point_installs_into_a_fresh_venv(tmp_path):
    """scripts/sglang/setup_venv.sh installs kvsidecar's metadata with install_metadata.py: in a
    brand-new virtualenv, SGLang's plugin group then names kvsidecar.connector.sglang_plugin:load from this
    checkout (what SGLang's load_plugins() discovers in every scheduler process)."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["sglang.srt.plugins"] == {"kvsidecar": "kvsidecar.connector.sglang_plugin:load"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, str(ROOT / "scripts" / "sglang" / "install_metadata.py")], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "connector imported from " + str(ROOT) in r.stdout
    probe = ("from importlib.metadata import entry_points; import json; "
             "print(json.dumps([[e.name, e.value, e.dist.name] for e in entry_points(group='sglang.srt.plugins')]))")
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert json.loads(r.stdout) == [["kvsidecar", "kvsidecar.connector.sglang_plugin:load", "kvsidecar"]], r.stderr
    r = subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('kvsidecar.connector.sglang_plugin').origin)"],
                       capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.stdout.strip().startswith(str(ROOT)), r.stderr
