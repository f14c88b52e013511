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

It runs again on request (``start`` once the previous run ended: the write-behind gate re-measures
a tier it stopped writing to, ``kvsidecar.sidecar.l3.write_gate``): the same keys and mapping,
registered once; a run that fails leaves the next one free to try.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time

log = logging.getLogger(__name__)


class Calibration:
    """Measurements of the tier (``L3Tier``), one at a time, started on the control thread;
    ``on_done(measured)`` runs there when each ends (``measured``: every write and read was observed)."""

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
        self.registered: bool | None = None  # None: not tried yet; False: the backend refused it
        self.runs = 0

    @property
    def running(self) -> bool:
        return self.result.get("state") == "running"

    def start(self) -> bool:
        """Register the scratch mapping (the first time) and queue the first write (control
        thread).  False, and nothing started, while a run is in flight or when the backend
        refused the mapping."""
        if self.running or self.registered is False:
            return False
        if self.registered is None:
            try:
                self.tier.backend.register_pool(self._address, len(self._map))
                self.registered = True
            except Exception as exc:  # (a backend that cannot register more memory: no calibration)
                self.registered = False
                self._end(f"register failed: {exc}")
                return False
        self.runs += 1
        self.result = {"state": "running", "run": self.runs}
        self._next()
        return True

    def _steps(self) -> list:
        """(operation, blocks) in order: write 1, then all, then read them back the same way."""
        sizes = (1, self.blocks) if self.blocks > 1 else (1,)
        return [("write", n) for n in sizes] + [("read", n) for n in sizes]

    def _next(self, done: int = 0) -> None:
        """Run step ``done`` on the write lane (never the read lane: a request's read must not
        wait behind the calibration, nor behind a calibration read in a stuck tier); the calls are
        the backend's own ``write`` and ``read``, the ones a put and a restore make."""
        steps = self._steps()
        if done == len(steps):
            self._end(None)
            return
        op, n = steps[done]
        call, keys, addrs, size = getattr(self.tier.backend, op), self.keys[:n], self.addrs[:n], self.tier.block_bytes

        def work():
            t0 = time.monotonic()
            ok = call(keys, addrs, size)
            return list(ok), time.monotonic() - t0

        self.tier.writer.submit(work, lambda result, error: self._landed(done, op, n, result, error))

    def _landed(self, done: int, op: str, n: int, result, error) -> None:
        ok, seconds = result if error is None and result is not None else ([False], 0.0)
        if not all(ok):  # (what was measured so far stays the estimate)
            self._end(f"the {op} of {n} block(s) failed" + (f": {error}" if error is not None else ""))
            return
        if op == "write":
            self.tier.cost.observe_write(n, seconds)  # (``write_samples`` in the L3 stats until a read)
        else:
            self.tier.cost.observe(n, seconds)  # (``samples`` in the L3 stats)
        self.result[f"{op}_{n}_ms"] = round(seconds * 1e3, 3)
        self._next(done + 1)

    def _end(self, failure: str | None) -> None:
        est = self.tier.cost.estimate()
        measured = failure is None
        self.result.update(state="done" if measured else "failed", latency_ms=round(est.latency_s * 1e3, 3),
                           ms_per_block=round(est.s_per_block * 1e3, 4))
        if measured:
            log.log(logging.INFO if self.runs == 1 else logging.DEBUG, "L3 measured (run %d): %.2f ms + %.3f ms/block "
                    "(%s)", self.runs, est.latency_s * 1e3, est.s_per_block * 1e3, self.result)
        else:
            self.result["failure"] = failure
            self.tier.counters["calibration_failed"] += 1
            log.warning("L3 calibration (run %d) measured nothing (%s): the estimate stays as it was",
                        self.runs, failure)
        if self.on_done is not None:
            self.on_done(measured)
