"""Mooncake Store backend: zero-copy reads and writes between the pool and the cluster.

The sidecar registers its whole pool mapping once (``register_buffer``), so
``batch_get_into`` / ``batch_put_from`` move bytes straight between the pool and the
cluster.  Calls are split into batches of at most 1024 keys.  Per-key results are
mapped to per-block booleans; error codes are counted (``-704`` object not found,
``-706`` lease expired, ``-800`` transfer failed, ``-900`` RPC failed, others by value).

Set-up is bounded: the master's RPC port is probed with a TCP connect first, because
``setup()`` against an absent master blocks for about 90 s.  The client is created
only in the process that uses it (Mooncake is not fork-safe).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading

from kvsidecar.sidecar.l3.base import L3Backend, L3Error, batched

log = logging.getLogger(__name__)

ERROR_NAMES = {-704: "not_found", -706: "lease_expired", -800: "transfer_failed", -900: "rpc_failed",
               -600: "buffer_too_small"}


def probe(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise L3Error(f"Mooncake master {address} is not reachable: {exc}") from None


class MooncakeBackend(L3Backend):
    name = "mooncake"

    def __init__(self, master: str, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 global_segment_bytes: int = 256 << 20, local_buffer_bytes: int = 64 << 20,
                 setup_timeout_s: float = 5.0, rdma_devices: str = ""):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise L3Error(f"mooncake is not installed: {exc}") from None
        probe(master, setup_timeout_s)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, "P2PHANDSHAKE", global_segment_bytes, local_buffer_bytes,
                              protocol, rdma_devices, master)
        if rc != 0:
            raise L3Error(f"Mooncake setup against {master} failed with code {rc}")
        self.master = master
        self.close_timeout_s = 3.0
        self.counters = collections.Counter()
        self._registered: list[int] = []
        log.info("Mooncake client connected to master %s (%s)", master, protocol)

    def register_pool(self, address: int, size: int) -> None:
        rc = self.store.register_buffer(address, size)
        if rc != 0:
            raise L3Error(f"registering the pool with Mooncake failed with code {rc}")
        self._registered.append(address)

    def _count(self, codes) -> None:
        for c in codes:
            if c < 0:
                self.counters[f"err_{ERROR_NAMES.get(c, c)}"] += 1

    def exists(self, keys):
        out = []
        for a, b in batched(len(keys), self.max_batch):
            codes = self.store.batch_is_exist(keys[a:b])
            self._count([c for c in codes if c < 0])
            out.extend(c == 1 for c in codes)
        return out

    def read(self, keys, addrs, size, tails=None, tail_size=0):
        out = []
        total = size + (tail_size if tails else 0)
        for a, b in batched(len(keys), self.max_batch):
            if tails:  # block + checksum row as one object, into two registered buffers
                codes = self.store.batch_get_into_multi_buffers(
                    keys[a:b], [[d, t] for d, t in zip(addrs[a:b], tails[a:b])], [[size, tail_size]] * (b - a))
            else:
                codes = self.store.batch_get_into(keys[a:b], list(addrs[a:b]), [size] * (b - a))
            self._count(codes)
            out.extend(c == total for c in codes)
        self.counters["read_ok"] += sum(out)
        return out

    def write(self, keys, addrs, size, tails=None, tail_size=0):
        out = []
        for a, b in batched(len(keys), self.max_batch):
            if tails:
                codes = self.store.batch_put_from_multi_buffers(
                    keys[a:b], [[d, t] for d, t in zip(addrs[a:b], tails[a:b])], [[size, tail_size]] * (b - a))
            else:
                codes = self.store.batch_put_from(keys[a:b], list(addrs[a:b]), [size] * (b - a))
            self._count(codes)
            out.extend(c == 0 for c in codes)
        self.counters["write_ok"] += sum(out)
        return out

    def stats(self) -> dict:
        return {"backend": self.name, "master": self.master, **dict(self.counters)}

    def close(self) -> None:
        for addr in self._registered:
            try:
                self.store.unregister_buffer(addr)
            except Exception:  # closing must not raise
                log.exception("unregister_buffer failed")
        self._registered.clear()

        def _close():
            try:
                self.store.close()
            except Exception:
                log.exception("Mooncake close failed")

        # close() can take >10 s when the master is gone; never let it hold up shutdown.
        t = threading.Thread(target=_close, name="mooncake-close", daemon=True)
        t.start()
        t.join(self.close_timeout_s)
        if t.is_alive():
            log.warning("Mooncake close did not finish in %.1f s; leaving it behind", self.close_timeout_s)
