"""An online estimate of what one L3 read costs: ``seconds = latency + blocks x s_per_block``.

Fitted from completed reads by exponentially weighted least squares (each new read weighs
``1 / forget`` times the one before it, so a bandwidth change is tracked within a few reads),
regularised towards a configured prior — conservative (a slow L3) so that, before any evidence,
the ``cost_aware`` policy restores only what it can hide behind the queue.  Reads of one chunk
size (sizes within ``SAME_SIZE`` of their mean) cannot separate latency from bandwidth; the
prior's split is then kept, scaled down to what the reads took when they ran faster than the
prior said (never above the prior latency nor the fastest read), and the data sets the
per-block cost, which is exact for that size.  (Keeping the prior's 5 ms latency whole after
a 4-block probe that took 5.4 ms made the per-block cost 0.1 ms; the next reads then looked
like a change of regime, and the fit restarted from two reads of 30 and 34 blocks put the
latency at 13 ms: every 2-block tail was judged 15 ms to restore against 3 ms real.)

Until the first read is measured, the tier's own writes are the evidence: the write-behind
puts every prefilled block through the same link, so their measured cost (fitted the same way,
:meth:`ReadCostModel.observe_write`) replaces the configured prior — a guess that was 40x off at
2 Mbit/s — and ``cost_aware`` plans on it from the first request after a start instead of
losing that request to a probe.  Writes stop counting at the first read: reads decide.

The per-block cost is the time past the latency over the blocks, each read weighing by its
blocks (forgetting ``forget`` per read): a 2-block read's sample is mostly its latency's noise,
a 34-block read's is the bandwidth.  (Weighed alike, one 2-block read slowed to 8 ms by a busy
CPU doubled the per-block cost of a tier that reads a block in 1 ms; every short tail after it
looked dearer than its prefill, none was read, and nothing corrected the estimate.)

Two reads in a row more than ``CHANGE`` off their prediction the same way mark a change of
regime: the long memory restarts from those two reads (otherwise, with reads of mixed sizes, it
fits one line through both regimes and a bandwidth change shows up as latency).  One such read
alone does not enter the fit until the next says which it was: a regime (it enters with it) or
noise (it never does).  (Counted as ``CHANGE`` off its prediction, one 2-block tail slowed to
7.3 ms by a busy CPU, among tails of 3.4 ms, raised the per-block cost 44 %; with the error
margin every tail after it looked dearer than its prefill and was recomputed, and since nothing
was read no read came to say it was noise: nine requests in a row, each ~1.4 ms later than
reading, real table r0.3-idle-tp2.)  It counts in ``error`` at once: it was a miss.
Also tracks how good it is: the weighted mean of ``|predicted - measured| / measured``
over the reads it predicted once it had evidence (``error``; the prior's guess is not counted).  One instance per tier (per backend); control thread only.
"""

from __future__ import annotations

import dataclasses

CHANGE = 0.5  # a read off its prediction by more than this share, twice in a row the same way: a new regime
SAME_SIZE = 0.1  # reads whose sizes spread less than this share of their mean cannot split latency from bandwidth


@dataclasses.dataclass(frozen=True)
class ReadEstimate:
    latency_s: float
    s_per_block: float
    samples: int  # reads observed (0: the prior, or the writes, alone)
    write_samples: int = 0  # writes observed while no read was (their fit is the estimate until one is)

    @property
    def measured(self) -> bool:
        """Backed by evidence from this tier (reads, or before any read, writes), not the prior."""
        return self.samples > 0 or self.write_samples > 0

    def seconds(self, blocks: int) -> float:
        return self.latency_s + blocks * self.s_per_block


class ReadCostModel:
    def __init__(self, prior_latency_s: float, prior_s_per_block: float, *, forget: float = 0.5,
                 latency_forget: float = 0.95, prior_weight: float = 0.5):
        if not (prior_latency_s >= 0 and prior_s_per_block > 0 and 0 < forget < 1 and 0 < latency_forget < 1
                and prior_weight > 0):
            raise ValueError("ReadCostModel: bad prior or forgetting factor")
        self.prior = (prior_latency_s, prior_s_per_block)
        self.forget = forget  # the per-block cost: tracks a bandwidth change within a few reads
        self.latency_forget = latency_forget  # the fixed cost: a long memory, to separate it at all
        self.prior_weight = prior_weight
        self._w = self._k = self._kk = self._s = self._ks = 0.0
        self._min_s = float("inf")
        self.samples = 0
        self._latency, self._per_block = prior_latency_s, prior_s_per_block
        self._pb_time = self._pb_blocks = 0.0  # the per-block cost's memory: time past latency / blocks
        self._err_num = self._err_den = 0.0
        self._surprise: tuple | None = None  # (blocks, seconds, signed error) of a read far off its prediction
        self._writes: ReadCostModel | None = None  # the fit of the writes, while no read is measured

    @property
    def error(self) -> float:
        """Weighted mean relative error of the predictions made before each read (0: none yet)."""
        return self._err_num / self._err_den if self._err_den else 0.0

    def estimate(self) -> ReadEstimate:
        if self.samples == 0 and self._writes is not None:
            w = self._writes
            return ReadEstimate(w._latency, w._per_block, 0, w.samples)
        return ReadEstimate(self._latency, self._per_block, self.samples)

    def observe_write(self, blocks: int, seconds: float) -> None:
        """One write of ``blocks`` blocks that took ``seconds``: the estimate while no read has
        been measured (ignored once one has)."""
        if self.samples or blocks <= 0 or not seconds >= 0 or seconds == float("inf"):
            return
        if self._writes is None:
            self._writes = ReadCostModel(*self.prior, forget=self.forget, latency_forget=self.latency_forget,
                                         prior_weight=self.prior_weight)
        self._writes.observe(blocks, seconds)

    def observe(self, blocks: int, seconds: float) -> None:
        """One read of ``blocks`` blocks that took ``seconds`` (all blocks landed)."""
        if blocks <= 0 or not seconds >= 0 or seconds == float("inf"):
            return
        changed = False
        if seconds > 0 and self.samples:  # predictions made with evidence (the prior's is not one)
            predicted = self._latency + blocks * self._per_block
            if self.samples >= 2:
                # (a prediction from one read carries the prior's split of latency and per-block
                # cost: its miss on a read of another size is the prior's error, not the fit's)
                rel = abs(predicted - seconds) / seconds
                self._err_num = self.forget * self._err_num + rel
                self._err_den = self.forget * self._err_den + 1.0
            surprise = (seconds - predicted) / predicted if predicted > 0 else 0.0
            if self.samples < 2:
                pass  # one read cannot split latency from bandwidth: its miss is no sign of a new regime
            elif abs(surprise) <= CHANGE:
                self._surprise = None
            elif self._surprise is not None and (self._surprise[2] > 0) == (surprise > 0):
                changed = True  # two reads in a row off the same way: the tier changed
            else:
                # one may be noise: it waits for the next read, out of the fit (a read slowed
                # by a busy CPU must not move the estimate: if it made reading look dear, no
                # read would come to correct it)
                self._surprise = (blocks, seconds, surprise)
                self.samples += 1
                return
        reads = [(blocks, seconds)]
        if changed:
            # the long memory would fit a line through both regimes (a bandwidth change then
            # shows up as latency): start it again from the two reads of the new one
            prev_blocks, prev_seconds, _ = self._surprise
            self._surprise = None
            self._w = self._k = self._kk = self._s = self._ks = 0.0
            self._min_s = float("inf")
            self._accumulate(prev_blocks, prev_seconds)
            reads.insert(0, (prev_blocks, prev_seconds))
            self._pb_time = self._pb_blocks = 0.0  # (a new regime: the old per-block cost is no guide)
        self._accumulate(blocks, seconds)
        self.samples += 1
        self._latency = self._fit_latency()
        a = self.forget  # per block: each read weighs by its blocks (see the module docstring)
        for k, sec in reads:
            self._pb_time = a * self._pb_time + max(0.0, sec - self._latency)
            self._pb_blocks = a * self._pb_blocks + k
        self._per_block = max(1e-9, self._pb_time / self._pb_blocks)

    def _accumulate(self, blocks: int, seconds: float) -> None:
        f = self.latency_forget
        self._w = f * self._w + 1.0
        self._k = f * self._k + blocks
        self._kk = f * self._kk + blocks * blocks
        self._s = f * self._s + seconds
        self._ks = f * self._ks + blocks * seconds
        self._min_s = min(self._min_s, seconds)

    def _fit_latency(self) -> float:
        """Least squares over the long memory, regularised towards the prior latency (which
        decides alone while every read had the same size); never above the fastest read."""
        l0, b0 = self.prior
        lam = self.prior_weight
        kbar = self._k / self._w
        var = self._kk / self._w - kbar * kbar
        if var <= (SAME_SIZE * kbar) ** 2 or var <= 1e-9:  # one size so far: the data cannot split it
            # the prior's split, scaled to what the reads took when faster than the prior said
            mean_s = self._s / self._w
            scale = min(1.0, mean_s / (l0 + kbar * b0)) if l0 + kbar * b0 > 0 else 1.0
            return min(l0 * scale, self._min_s)
        # centred regression: slope from the covariance, intercept at the mean; then shrink
        cov = self._ks / self._w - kbar * (self._s / self._w)
        slope = cov / var
        lat = self._s / self._w - slope * kbar
        lat = (self._w * lat + lam * l0) / (self._w + lam)
        return min(max(lat, 0.0), self._min_s)
