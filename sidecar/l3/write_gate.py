"""Whether a published store is worth writing behind to L3: only while reading it back could pay.

A block in L3 pays only when it is read instead of recomputed.  The read costs the tier's measured
per-block cost (``ReadCostModel``: its calibration and its reads), the recompute the engine's prefill
cost per block (cost_aware's input, reported with each cost_aware session and carried by its
``SessionOutcome``).  When a block takes more than ``max_ratio`` times longer to read than to
prefill, a read of it pays only by hiding behind a queue wait ``max_ratio`` prefills long; the
write-behind then buys next to nothing while it takes the link, the lanes and the CPU the engine
computes on.  (Genuine SGLang at 8 Mbit/s: a block reads in ~16 ms, 4-12x the prefill cost per
block SGLang's own counters give; cost_aware read none of it, and the write-behind put ~1,250
blocks a stream over that link, twice the sidecar's CPU; paused, nothing is written during the
streams and the paired TTFT against no prefetch went from +7.4 to +3.8 ms at the median over
1,024 requests, the slowest fifth's penalty about halved.)  While the gate is closed a store is
published in the pool only, and counted (``l3_put_gated_blocks``).

Invariants:

* **Never closed on a guess.**  Open until the tier's read cost is measured by a read (its
  calibration's or a request's; a write-only estimate can be far off a read) and an engine has
  reported its prefill cost; open when ``max_ratio`` is 0 (always write behind), and open when it
  has no means to re-measure (``remeasure`` is None: calibration off).
* **A closed gate does not freeze its evidence.**  Nothing is written, and at that ratio nothing is
  read, so the estimate that closed it would never change: while stores are refused, the tier is
  re-measured (``remeasure``: a ``Calibration`` on the write lane, which the refused stores leave
  idle) at most every ``recalibrate_s``.  A refused store triggers it (no timer: an idle sidecar
  measures nothing).
* **Hysteresis.**  It closes above ``max_ratio`` and opens again only at or below
  ``REOPEN x max_ratio``: an engine's prefill cost moves with its batches, and a ratio near the
  bound must not flip the gate (and its log line) on every store.

What it gives up: an L3 that other nodes read, or that outlives this node's pool, gets none of this
node's blocks while closed.  ``l3.write_behind_max_ratio = 0`` keeps the write-behind regardless.
Control thread only (``session_ended`` is told there by the session manager's observers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvsidecar.sidecar.observe.outcome import SessionObserver

log = logging.getLogger(__name__)

REOPEN = 0.8  # reopens at or below this share of max_ratio (closes above max_ratio)


class WriteBehindGate(SessionObserver):
    def __init__(self, read_estimate: Callable, max_ratio: float, recalibrate_s: float, *,
                 remeasure: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic):
        """``read_estimate()``: the tier's current ``ReadEstimate``; ``remeasure()``: start a
        measurement of the tier, False when it cannot (one is already running)."""
        if not (max_ratio >= 0 and recalibrate_s > 0):
            raise ValueError("WriteBehindGate: max_ratio must be >= 0 and recalibrate_s positive")
        self.read_estimate = read_estimate
        self.max_ratio = max_ratio
        self.recalibrate_s = recalibrate_s
        self.remeasure = remeasure
        self.clock = clock
        self.prefill_s_per_block = 0.0  # the last an engine reported (0: none yet)
        self.open = True
        self.closed_at: float | None = None
        self.closings = 0
        self.paused_s = 0.0  # time paused, closed periods that ended (stats add the current one)
        self.remeasures = 0
        self._last_measured = float("-inf")

    # -- evidence -----------------------------------------------------------------------------------
    def session_ended(self, outcome) -> None:
        p = getattr(outcome, "prefill_s_per_block", 0.0)
        if p and p > 0:
            self.prefill_s_per_block = p

    def ratio(self) -> float | None:
        """Read cost over prefill cost per block, or None while either is unmeasured."""
        est = self.read_estimate()
        if est.samples <= 0 or self.prefill_s_per_block <= 0:
            return None
        return est.s_per_block / self.prefill_s_per_block

    # -- the decision ---------------------------------------------------------------------------------
    def admits(self) -> bool:
        """Whether the store being published now is written behind (and, closed, whether it is
        time to re-measure the tier)."""
        if self.max_ratio <= 0 or self.remeasure is None:
            return True
        r = self.ratio()
        now = self.clock()
        if self.open and r is not None and r > self.max_ratio:
            self.open, self.closed_at, self.closings = False, now, self.closings + 1
            self._last_measured = now  # (the evidence that closed it is fresh)
            log.info("L3 write-behind paused: a block reads in %.3f ms, %.1fx its prefill (%.3f ms; bound %gx); "
                     "stores stay in the pool, the tier is re-measured every %g s",
                     self.read_estimate().s_per_block * 1e3, r, self.prefill_s_per_block * 1e3, self.max_ratio,
                     self.recalibrate_s)
        elif not self.open and (r is None or r <= REOPEN * self.max_ratio):
            log.info("L3 write-behind resumed after %.1f s: %s", now - self.closed_at,
                     "the ratio is unmeasured" if r is None else f"a block reads in {r:.1f}x its prefill")
            self.paused_s += now - self.closed_at
            self.open, self.closed_at = True, None
        if not self.open and now - self._last_measured >= self.recalibrate_s and self.remeasure():
            self._last_measured = now
            self.remeasures += 1
        return self.open

    def stats(self) -> dict:
        r = self.ratio()
        closed_s = self.clock() - self.closed_at if self.closed_at is not None else 0.0
        return {"open": self.open, "max_ratio": self.max_ratio, "ratio": round(r, 3) if r is not None else None,
                "prefill_ms_per_block": round(self.prefill_s_per_block * 1e3, 4), "closed_s": round(closed_s, 3),
                "paused_s": round(self.paused_s + closed_s, 3), "closings": self.closings,
                "remeasures": self.remeasures}


__all__ = ["REOPEN", "WriteBehindGate"]
