"""The control thread's side of L3: lookup → load, and store after commit.

Policy runs here (which keys, which pool blocks, what to publish); the bytes move on
the worker lanes.  Every completion comes back to the control thread as an event.
L3 keys are ``kvs1/<layout fingerprint>/<namespace>/<block hash>``: the namespace and
the layout are in every key, so two namespaces or layouts never share an object.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from shm.chain import count as id_count, keys as chain_keys
from sidecar.kv.index import unpack_ids
from sidecar.l3.base import L3Backend
from sidecar.l3.workers import Lane

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ReadResult:
    """What one L3 read did: per-block success and how long the backend call took."""

    ok: list
    seconds: float

    @property
    def landed(self) -> int:
        return sum(self.ok)


class L3Tier:
    def __init__(self, backend: L3Backend, post, *, fingerprint: bytes, pool_address: int, block_bytes: int):
        self.backend = backend
        self.prefix = f"kvs1/{fingerprint.hex()}"
        self.pool_address = pool_address
        self.block_bytes = block_bytes
        self.meta = Lane("l3-meta", post)
        self.reader = Lane("l3-read", post)
        self.writer = Lane("l3-write", post)
        self.counters = collections.Counter()
        # running estimate of one block's read time (EWMA over successful reads; None until one)
        self.read_s_per_block: float | None = None

    def start(self) -> None:
        for lane in (self.meta, self.reader, self.writer):
            lane.start()

    def stop(self) -> None:
        self.backend.interrupt()
        for lane in (self.meta, self.reader, self.writer):
            lane.stop()
        self.backend.close()

    def keys(self, ns: str, chain: bytes) -> list[str]:
        p = f"{self.prefix}/{ns}/"
        return [p + k.hex() for k in chain_keys(chain)]

    def addrs(self, blocks: bytes) -> list[int]:
        base, bb = self.pool_address, self.block_bytes
        return [base + b * bb for b in unpack_ids(blocks)]

    # -- operations (control thread) ------------------------------------------------------------
    def lookup(self, ns: str, chain: bytes, done) -> None:
        """``done(hits)``: how many leading blocks of ``chain`` L3 holds (0 on error)."""
        keys = self.keys(ns, chain)
        self.counters["lookups"] += 1

        def finish(flags, error):
            if error is not None or flags is None:
                self.counters["lookup_errors"] += 1
                done(0)
                return
            hits = 0
            while hits < len(flags) and flags[hits]:
                hits += 1
            done(hits)

        self.meta.submit(lambda: self.backend.exists(keys), finish)

    def load(self, ns: str, chain: bytes, blocks: bytes, done, priority: int = 1):
        """Read ``chain``'s blocks into pool ``blocks``; ``done(ReadResult)`` on the control thread."""
        keys, addrs, n = self.keys(ns, chain), self.addrs(blocks), id_count(blocks)
        size = self.block_bytes

        def work():
            t0 = time.monotonic()
            return ReadResult(list(self.backend.read(keys, addrs, size)), time.monotonic() - t0)

        def finish(result, error):
            if error is not None or result is None:
                result = ReadResult([False] * n, 0.0)
            good = result.landed
            self.counters["read_blocks_ok"] += good
            self.counters["read_blocks_failed"] += n - good
            if good:
                sample = result.seconds / n
                prev = self.read_s_per_block
                self.read_s_per_block = sample if prev is None else 0.8 * prev + 0.2 * sample
            done(result)

        return self.reader.submit(work, finish, priority)

    def store(self, ns: str, chain: bytes, blocks: bytes, done) -> None:
        """Write pool ``blocks`` under ``chain``'s keys; ``done(per_block_ok)``."""
        keys, addrs, n = self.keys(ns, chain), self.addrs(blocks), id_count(blocks)
        size = self.block_bytes

        def finish(ok, error):
            if error is not None or ok is None:
                ok = [False] * n
            self.counters["put_blocks_ok"] += sum(ok)
            self.counters["put_blocks_failed"] += n - sum(ok)
            done(ok)

        self.writer.submit(lambda: self.backend.write(keys, addrs, size), finish)

    def stats(self) -> dict:
        return {**dict(self.counters), "meta": self.meta.stats(), "read": self.reader.stats(),
                "write": self.writer.stats(), "backend": self.backend.stats()}
