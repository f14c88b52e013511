"""Measuring the L3 tier at start, before the first request needs the estimate.

A fresh sidecar's read-cost estimate is the configured prior (measured: 40x off at 2 Mbit/s)
until a read or a write of its own lands.  Without evidence ``cost_aware`` has to probe with the
first request's blocks: the request waits for the probe (or gives it up) and is decided on a
guess; requests that come while it is out restore nothing (the real table: the first request
of a run waited for its probe while the next one was admitted ahead of it, +100 ms on every
request of the congestion that followed).  So the tier measures itself as it starts: it writes
one scratch object, then ``blocks`` of them, and reads them back the same way (1, then all) —
two sizes each, so the fit can split the fixed cost of a call from its per-block cost.  The
reads are the estimate (``ReadCostModel.observe``); the writes only until a read lands (a write
can cost far more than a read: on the file store at 0.3x the prefill cost per block, a write
estimate alone made cost_aware recompute every idle request, and at an idle engine nothing is
read that would correct it).

Everything runs on the tier's write lane: the read lane is never taken from a request (nor held
by a calibration read in a stuck tier); at start the write-behind has nothing to put yet.
The scratch memory is this module's own anonymous mapping, registered with the backend like the
pool: the pool's blocks are never touched, so there is no block state to account for, and no
request can see these bytes.  Keys: ``<tier prefix>/_calibration/<i>`` — a fixed, small set per
layout (``blocks`` objects), never a request's key (those are block hashes under a namespace).
A failure measures nothing more (the estimate stays what was measured, else the prior, and
sessions probe as before; ``calibration_failed`` in the L3 stats) and never fails the sidecar.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time

log = logging.getLogger(__name__)


class Calibration:
    """One measurement of the tier (``L3Tier``), started once on the control thread;
    ``on_done(measured)`` runs there when it ends (``measured``: every write and read was observed)."""

    def __init__(self, tier, blocks: int, on_done=None):
        if blocks < 1:
            raise ValueError("Calibration needs at least one block")
        self.tier = tier
        self.blocks = blocks
        self.on_done = on_done
        size = tier.block_bytes
        self._map = mmap.mmap(-1, blocks * size)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.keys = [f"{tier.prefix}/_calibration/{i}" for i in range(blocks)]
        self.addrs = [self._address + i * size for i in range(blocks)]
        self.result: dict = {"state": "idle"}

    def start(self) -> None:
        """Register the scratch mapping and queue the first write (control thread)."""
        try:
            self.tier.backend.register_pool(self._address, len(self._map))
        except Exception as exc:  # (a backend that cannot register more memory: no calibration)
            self._end(f"register failed: {exc}")
            return
        self.result = {"state": "running"}
        self._write(1)

    def _write(self, n: int) -> None:
        keys, addrs, size = self.keys[:n], self.addrs[:n], self.tier.block_bytes
        backend = self.tier.backend

        def work():
            t0 = time.monotonic()
            ok = backend.write(keys, addrs, size)
            return list(ok), time.monotonic() - t0

        self.tier.writer.submit(work, lambda result, error: self._written(n, result, error))

    def _written(self, n: int, result, error) -> None:
        ok, seconds = result if error is None and result is not None else ([False], 0.0)
        if not all(ok):
            self._end(f"the write of {n} block(s) failed" + (f": {error}" if error is not None else ""))
            return
        self.tier.cost.observe_write(n, seconds)  # (``write_samples`` in the L3 stats until a read)
        self.result[f"write_{n}_ms"] = round(seconds * 1e3, 3)
        if n < self.blocks:
            self._write(self.blocks)
            return
        self._read(1)

    def _read(self, n: int) -> None:
        """Read back on the write lane (never the read lane: a request's read must not wait
        behind the calibration); the call is the backend's read, the one a restore makes."""
        keys, addrs, size = self.keys[:n], self.addrs[:n], self.tier.block_bytes
        backend = self.tier.backend

        def work():
            t0 = time.monotonic()
            ok = backend.read(keys, addrs, size)
            return list(ok), time.monotonic() - t0

        self.tier.writer.submit(work, lambda result, error: self._read_back(n, result, error))

    def _read_back(self, n: int, result, error) -> None:
        ok, seconds = result if error is None and result is not None else ([False], 0.0)
        if not all(ok):  # (the writes measured the link: they stay the estimate until a read lands)
            self._end(f"the read of {n} block(s) failed" + (f": {error}" if error is not None else ""))
            return
        self.tier.cost.observe(n, seconds)  # (``samples`` in the L3 stats)
        self.result[f"read_{n}_ms"] = round(seconds * 1e3, 3)
        if n < self.blocks:
            self._read(self.blocks)
            return
        self._end(None)

    def _end(self, failure: str | None) -> None:
        est = self.tier.cost.estimate()
        measured = failure is None
        self.result.update(state="done" if measured else "failed", latency_ms=round(est.latency_s * 1e3, 3),
                           ms_per_block=round(est.s_per_block * 1e3, 4))
        if measured:
            log.info("L3 measured at start: %.2f ms + %.3f ms/block (%s)", est.latency_s * 1e3,
                     est.s_per_block * 1e3, self.result)
        else:
            self.result["failure"] = failure
            self.tier.counters["calibration_failed"] += 1
            log.warning("L3 calibration at start measured nothing (%s): cost_aware probes instead", failure)
        if self.on_done is not None:
            self.on_done(measured)
