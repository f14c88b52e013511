"""The control thread's side of L3: lookup → load, and store after commit.

Policy runs here (which keys, which pool blocks, what to publish); the bytes move on
the worker lanes.  Every completion comes back to the control thread as an event.
L3 keys are ``kvs2/<layout fingerprint>/<namespace>/<block hash>``: the namespace and
the layout are in every key, so two namespaces or layouts never share an object.

Integrity (with a checksum table): an object is the block followed by its checksum row
(one XXH3-64 per shard, written by the block's writers); a read lands both in one transfer
and the read lane verifies every landed block against its row before the result goes back
(a large pass in two halves at once, one on a checker thread)
— a block whose bytes do not match is a failed block (``read_blocks_corrupt``), so it is
never published and the session's prefix ends before it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time

from kvsidecar.shm.chain import KEY_BYTES, count as id_count, keys as chain_keys
from kvsidecar.sidecar.kv.checksums import ChecksumTable
from kvsidecar.sidecar.kv.index import pack_ids, unpack_ids
from kvsidecar.sidecar.l3.base import L3Backend
from kvsidecar.sidecar.l3.cost_model import ReadCostModel
from kvsidecar.sidecar.l3.interface import (DEMANDED, QUEUED, ReadOutlook, ReadResult,  # noqa: F401 (re-exported)
                                           read_priority)
from kvsidecar.sidecar.l3.workers import Job, Lane

log = logging.getLogger(__name__)

# A read's checksum pass is split across two threads (the lane's and a checker) once it covers
# at least this many bytes (bench l3's warm row: the pass is ~15 % of the read's time here).
SPLIT_VERIFY_BYTES = 8 << 20


class ReadHandle:
    """A read on the lane (an :class:`~kvsidecar.sidecar.l3.interface.ReadJob`); ``cancel()``
    withdraws it if it has not started (control thread)."""

    __slots__ = ("_lane", "_job")

    def __init__(self, lane: Lane, job: Job):
        self._lane, self._job = lane, job

    def cancel(self) -> bool:
        return self._lane.cancel(self._job)

    def raise_priority(self, priority: int) -> None:
        """Run sooner if still queued (e.g. its request became a scheduling candidate)."""
        self._lane.raise_priority(self._job, priority)


class L3Tier:
    """The real tier: worker lanes over a backend.  Its session-facing side (``lookup``, ``load``,
    ``read_outlook`` and the estimates) is :class:`~kvsidecar.sidecar.l3.interface.SessionTier`;
    ``store``, ``snapshot`` and the lifecycle are the composition root's and ``L3Ops``'."""

    def __init__(self, backend: L3Backend, post, *, fingerprint: bytes, pool_address: int, block_bytes: int,
                 cost_model: ReadCostModel | None = None, sums: ChecksumTable | None = None, read_lanes: int = 1,
                 landing=None):
        """``landing``: the sidecar's background populate of its pool mapping (or None); every
        read runs inside its ``copying()``, so the populate pauses while a read lands rather than
        fault the same mapping beside it, and ``stats()`` reports it (``pool_populate``)."""
        self.backend = backend
        self.sums = sums
        self.prefix = f"kvs2/{fingerprint.hex()}"
        self.pool_address = pool_address
        self.block_bytes = block_bytes
        self.landing = landing
        self.meta = Lane("l3-meta", post)
        self.reader = Lane("l3-read", post, threads=read_lanes, around=self._landing_pause)
        # the other half of a large read's checksum pass (GIL released: it runs beside the lane)
        self._checker = concurrent.futures.ThreadPoolExecutor(read_lanes, thread_name_prefix="l3-verify")
        self.writer = Lane("l3-write", post)
        self.counters = collections.Counter()
        # running estimate of one block's read time (EWMA over successful reads; None until one)
        self.read_s_per_block: float | None = None
        # latency + per-block cost of a read (cost_aware's L3 input); the default prior is a
        # conservative 5 ms + 10 MB/s until reads say otherwise (l3.cost_prior_* in the config)
        self.cost = cost_model or ReadCostModel(0.005, block_bytes / 10e6)
        self.query_s = 0.0  # EWMA of an existence query's latency, as a session sees it (0: none yet)

    @property
    def read_cost_error(self) -> float:
        """The read-cost model's measured prediction error (SessionTier)."""
        return self.cost.error

    def _landing_pause(self):
        landing = self.landing
        return landing.copying() if landing is not None else contextlib.nullcontext()

    def start(self) -> None:
        for lane in (self.meta, self.reader, self.writer):
            lane.start()

    def stop(self) -> None:
        self.backend.interrupt()
        for lane in (self.meta, self.reader, self.writer):
            lane.stop()
        self._checker.shutdown(wait=True)
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
        t0 = time.monotonic()

        def finish(flags, error):
            took = time.monotonic() - t0  # submit -> answer on the control thread: what a session waits
            self.query_s = took if not self.query_s else 0.8 * self.query_s + 0.2 * took
            if error is not None or flags is None:
                self.counters["lookup_errors"] += 1
                done(0)
                return
            hits = 0
            while hits < len(flags) and flags[hits]:
                hits += 1
            done(hits)

        self.meta.submit(lambda: self.backend.exists(keys), finish)

    def load(self, ns: str, chain: bytes, blocks: bytes, done, priority: int = QUEUED):
        """Read ``chain``'s blocks into pool ``blocks``; ``done(ReadResult)`` on the control thread."""
        keys, addrs, n = self.keys(ns, chain), self.addrs(blocks), id_count(blocks)
        size = self.block_bytes
        sums = self.sums
        tails = sums.row_addresses(unpack_ids(blocks)) if sums is not None else None
        corrupt = [0]

        def work():  # (on the read lane)
            t0 = time.monotonic()
            ok = list(self.backend.read(keys, addrs, size, tails, sums.row_bytes if sums else 0))
            if sums is not None and any(ok):
                ids = unpack_ids(blocks)
                landed = [i for i, o in enumerate(ok) if o]
                match = self._verify(landed, ids, chain)
                for i, m in zip(landed, match):
                    if not m:
                        ok[i] = False
                        corrupt[0] += 1
                        log.warning("L3 object %s does not match its checksum: not published", keys[i])
            return ReadResult(ok, time.monotonic() - t0)

        def finish(result, error):
            if error is not None or result is None:
                result = ReadResult([False] * n, 0.0)
            good = result.landed
            self.counters["read_blocks_ok"] += good
            self.counters["read_blocks_failed"] += n - good
            self.counters["read_blocks_corrupt"] += corrupt[0]
            if good:
                sample = result.seconds / n
                prev = self.read_s_per_block
                self.read_s_per_block = sample if prev is None else 0.8 * prev + 0.2 * sample
            if good == n:
                self.cost.observe(n, result.seconds)
            done(result)

        return ReadHandle(self.reader, self.reader.submit(work, finish, priority, weight=n))

    def _verify(self, landed: list[int], ids: list[int], chain: bytes) -> bytes:
        """Per block index of ``landed``: 1 when its bytes in the pool match its checksum row.
        A pass over at least ``SPLIT_VERIFY_BYTES`` runs in two halves at once, one on the
        checker (read lane)."""
        def check(part):
            return self.sums.verify(self.pool_address, self.block_bytes, pack_ids([ids[i] for i in part]),
                                    b"".join(chain[KEY_BYTES * i:KEY_BYTES * (i + 1)] for i in part))

        if len(landed) * self.block_bytes < SPLIT_VERIFY_BYTES:
            return check(landed)
        half = len(landed) // 2
        other = self._checker.submit(check, landed[half:])
        return check(landed[:half]) + other.result()

    def read_outlook(self, priority: int = QUEUED) -> ReadOutlook:
        """The cost estimate and the read-lane backlog a new read of ``priority`` would face."""
        est = self.cost.estimate()
        jobs, blocks = self.reader.ahead(priority)
        return ReadOutlook(est, jobs * est.latency_s + blocks * est.s_per_block)

    def store(self, ns: str, chain: bytes, blocks: bytes, done) -> None:
        """Write pool ``blocks`` under ``chain``'s keys; ``done(per_block_ok)``.

        A block L3 already holds is not written again (one existence query first, on the write
        lane): keys name content (namespace, layout, chained block hash), so the object there
        is these bytes.  An engine writes through every prefix it recomputes, and on a cold
        node that is every shared prompt L3 has had for long; rewriting them took the write
        lane's bandwidth (and this process's CPU: a 128-block prompt is 128 objects) from the
        blocks L3 lacks.  Present blocks count as written (``put_blocks_present``); when the
        query fails, every block is written."""
        keys, addrs, n = self.keys(ns, chain), self.addrs(blocks), id_count(blocks)
        size = self.block_bytes
        sums = self.sums
        tails = sums.row_addresses(unpack_ids(blocks)) if sums is not None else None
        tail_bytes = sums.row_bytes if sums else 0

        def work():
            todo = self._absent(keys)
            t0 = time.monotonic()
            if len(todo) == n:
                return self.backend.write(keys, addrs, size, tails, tail_bytes), n, time.monotonic() - t0
            ok = [True] * n
            if todo:
                wrote = self.backend.write([keys[i] for i in todo], [addrs[i] for i in todo], size,
                                           [tails[i] for i in todo] if tails is not None else None, tail_bytes)
                for i, good in zip(todo, wrote):
                    ok[i] = good
            return ok, len(todo), time.monotonic() - t0

        def finish(result, error):
            ok, written, seconds = result if error is None and result is not None else (None, n, 0.0)
            if ok is None:
                ok = [False] * n
            self.counters["put_blocks_ok"] += sum(ok)
            self.counters["put_blocks_failed"] += n - sum(ok)
            self.counters["put_blocks_present"] += n - written
            if written and all(ok):
                self.cost.observe_write(written, seconds)  # the read estimate until a read is measured
            done(ok)

        self.writer.submit(work, finish)

    def _absent(self, keys: list[str]) -> list[int]:
        """Indices of the ``keys`` L3 does not hold (write lane); all of them when it cannot say."""
        try:
            present = self.backend.exists(keys)
        except Exception as exc:  # the write goes ahead: a failed query must not lose a write
            self.counters["put_exists_errors"] += 1
            log.warning("L3 existence query before a write failed (%s); writing every block", exc)
            return list(range(len(keys)))
        if len(present) != len(keys):
            self.counters["put_exists_errors"] += 1
            return list(range(len(keys)))
        return [i for i, p in enumerate(present) if not p]

    def stats(self) -> dict:
        return self.snapshot().stats()["l3"]

    def snapshot(self, *, puts_in_flight: int = 0, put_backlog_blocks: int = 0, loads_in_flight: int = 0,
                 write_gate: dict | None = None):
        """Counters, the backend's stats, the cost model and the lanes as one typed snapshot
        (``kvsidecar.sidecar.observe.snapshot.L3Snapshot``; the caller adds its in-flight counts)."""
        from kvsidecar.sidecar.observe.snapshot import CostSnapshot, L3Snapshot

        est = self.cost.estimate()
        landing = self.landing.stats() if self.landing is not None else {"method": "off", "done": True}
        return L3Snapshot(
            block_bytes=self.block_bytes, counters=dict(self.counters), backend=self.backend.stats(),
            read_s_per_block=self.read_s_per_block,
            cost=CostSnapshot(est.latency_s, est.s_per_block, est.samples, self.cost.error, est.write_samples),
            lanes={"meta": self.meta.stats(), "read": self.reader.stats(), "write": self.writer.stats(),
                   "pool_populate": landing},
            puts_in_flight=puts_in_flight, put_backlog_blocks=put_backlog_blocks, loads_in_flight=loads_in_flight,
            write_gate=write_gate)
