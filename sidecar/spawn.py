"""Start a sidecar as a child process and wait (bounded, no polling) until it is ready.

Used by the demo, the benchmarks and the tests.  The child announces readiness
on an inherited pipe; the parent blocks in ``select`` on it with a deadline.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parent.parent / "scripts" / "launch_sidecar.py"


class SidecarStartError(RuntimeError):
    """The sidecar child exited or stayed silent past the deadline."""


class SidecarProcess:
    def __init__(self, instance: str, *, config: str | None = None, overrides: dict | None = None,
                 log_level: str = "WARNING", start_timeout_s: float = 30.0, env: dict | None = None,
                 stderr=None):
        """``stderr``: where the child's log goes (a file object or fd; default: inherited)."""
        self.instance = instance
        args = [sys.executable, str(LAUNCHER), "--instance", instance, "--log-level", log_level]
        if config:
            args += ["--config", config]
        for key, value in (overrides or {}).items():
            args += ["--set", f"{key}={_toml_value(value)}"]
        rfd, wfd = os.pipe()
        args += ["--ready-fd", str(wfd)]
        self.proc = subprocess.Popen(args, pass_fds=(wfd,), env=env, stderr=stderr)
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
