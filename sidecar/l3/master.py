"""Start a local ``mooncake_master`` on 127.0.0.1 (tests, demo, ``l3.spawn_local_master``).

Ports are chosen free; readiness is a TCP connect to the RPC port, retried with a
short back-off until a deadline (the master is ready in ~0.3 s).  The master is
stopped by pid; it never outlives its owner's ``stop``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

from kvsidecar.sidecar.l3.base import L3Error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    def __init__(self, *, client_ttl_s: int = 2, kv_lease_ttl_ms: int = 200, start_timeout_s: float = 10.0,
                 rpc_port: int | None = None, extra_args: list | None = None, log_path: str | None = None):
        exe = shutil.which("mooncake_master")
        if exe is None:
            raise L3Error("mooncake_master is not on PATH (pip install mooncake-transfer-engine-non-cuda)")
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        args = [exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", f"--client_ttl={client_ttl_s}",
                f"--default_kv_lease_ttl={kv_lease_ttl_ms}", *(extra_args or [])]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if log_path:
            out.close()
        deadline = time.monotonic() + start_timeout_s
        pause = threading.Event()
        while True:
            if self.proc.poll() is not None:
                raise L3Error(f"mooncake_master exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise L3Error("mooncake_master did not start listening in time") from None
                pause.wait(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
        self.proc.wait(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
