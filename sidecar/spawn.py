"""Start a sidecar as a child process and wait (bounded, no polling) until it is ready.

Used by the demo, the benchmarks and the tests.  The child is ``python -m kvsidecar.sidecar``
(the launcher) under this interpreter; it announces readiness on an inherited pipe and
the parent blocks in ``select`` on it with a deadline.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# The directory holding the ``sidecar`` package this process imported (the repo root in a
# checkout, site-packages in an installed copy).
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def launcher_argv() -> list[str]:
    """The command that runs the launcher: this interpreter, ``-m kvsidecar.sidecar``."""
    return [sys.executable, "-m", "kvsidecar.sidecar"]


def child_env(env: dict | None = None, cwd: str | None = None) -> dict | None:
    """``env`` (default: this process's environment) such that ``python -m kvsidecar.sidecar`` started
    with it in ``cwd`` imports this very package.

    An installed kvsidecar (editable or not) needs nothing: None comes back when ``env`` was
    None, so the child simply inherits.  From a plain checkout that is not installed, the
    package root is put in front of the child's PYTHONPATH (the child's only: this process's
    environment is left alone)."""
    base = os.environ if env is None else env
    pythonpath = base.get("PYTHONPATH", "")
    if _finds_this_package(os.path.abspath(cwd or os.getcwd()), pythonpath):
        return env
    out = dict(base)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), pythonpath]))
    return out


@functools.lru_cache(maxsize=16)
def _finds_this_package(cwd: str, pythonpath: str) -> bool:
    """Whether a child started in ``cwd`` with ``pythonpath`` imports the package at _PACKAGE_ROOT."""
    if Path(cwd).resolve() == _PACKAGE_ROOT:
        return True  # ``-m`` puts the working directory first on sys.path
    probe = "import sidecar, sys; sys.stdout.write(sidecar.__file__)"
    env = dict(os.environ, PYTHONPATH=pythonpath)
    try:
        r = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and Path(r.stdout).resolve().parent.parent == _PACKAGE_ROOT


class SidecarStartError(RuntimeError):
    """The sidecar child exited or stayed silent past the deadline."""


class SidecarProcess:
    def __init__(self, instance: str, *, config: str | None = None, overrides: dict | None = None,
                 log_level: str = "WARNING", start_timeout_s: float = 30.0, env: dict | None = None,
                 stderr=None):
        """``stderr``: where the child's log goes (a file object or fd; default: inherited)."""
        self.instance = instance
        args = launcher_argv() + ["--instance", instance, "--log-level", log_level]
        if config:
            args += ["--config", config]
        for key, value in (overrides or {}).items():
            args += ["--set", f"{key}={_toml_value(value)}"]
        rfd, wfd = os.pipe()
        args += ["--ready-fd", str(wfd)]
        self.proc = subprocess.Popen(args, pass_fds=(wfd,), env=child_env(env), stderr=stderr)
        os.close(wfd)
        try:
            ready, _, _ = select.select([rfd], [], [], start_timeout_s)
            line = os.read(rfd, 256) if ready else b""
        finally:
            os.close(rfd)
        if not line:
            self.kill()
            raise SidecarStartError(f"sidecar {instance} did not become ready (exit code {self.proc.poll()})")
        pid, gen = line.split()
        self.pid = int(pid)
        self.generation = int(gen)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time.  Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL (a crash): segments stay behind until the next start replaces them."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot express {value!r} in TOML")
