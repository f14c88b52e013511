"""The write-behind gate (``kvsidecar.sidecar.l3.write_gate``) on the real read-cost model and a
fake clock, and the calibration it re-runs (``kvsidecar.sidecar.l3.calibrate``) on a real tier
(file store, real lanes): closed only on measured evidence, hysteresis, re-measured while closed
at most every ``recalibrate_s``, and a calibration that runs again with the same keys."""

from __future__ import annotations

import pytest

from kvsidecar.sidecar.l3.calibrate import Calibration
from kvsidecar.sidecar.l3.cost_model import ReadCostModel
from kvsidecar.sidecar.l3.write_gate import REOPEN, WriteBehindGate
from kvsidecar.sidecar.observe.outcome import SessionOutcome

from .test_tier_contract import RealHarness

MS = 1e-3


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def outcome(prefill_s_per_block: float) -> SessionOutcome:
    return SessionOutcome(session=1, request="r", group="g", policy="cost_aware", status="complete", reason="",
                          trigger="", blocks_total=4, blocks_resident=0, blocks_target=4, blocks_published=4,
                          prefix=4, blocks_restored=4, blocks_withdrawn=0, chunks=1, chunks_abandoned=0,
                          elapsed_s=0.01, stop_latency_s=None, drain_s=None, prefill_s_per_block=prefill_s_per_block)


def measured_model(s_per_block: float) -> ReadCostModel:
    """A read-cost model that has seen reads of 1 and 4 blocks at ``s_per_block`` (1 ms latency)."""
    m = ReadCostModel(5 * MS, 1 * MS)
    m.observe(1, 1 * MS + s_per_block)
    m.observe(4, 1 * MS + 4 * s_per_block)
    return m


class Gate:
    """A gate over ``model`` with a recorded ``remeasure`` that answers ``self.can``."""

    def __init__(self, model, max_ratio=10.0, recalibrate_s=30.0, remeasure=True):
        self.clock = Clock()
        self.calls = []
        self.can = True
        self.model = model
        self.gate = WriteBehindGate(model.estimate, max_ratio, recalibrate_s, clock=self.clock,
                                    remeasure=self._remeasure if remeasure else None)

    def _remeasure(self) -> bool:
        self.calls.append(self.clock.t)
        return self.can


def test_the_gate_stays_open_until_both_costs_are_measured():
    g = Gate(ReadCostModel(5 * MS, 100 * MS))  # the prior says 100 ms a block: a guess, not evidence
    g.gate.session_ended(outcome(0.1 * MS))
    assert g.gate.ratio() is None and g.gate.admits()
    g = Gate(measured_model(30 * MS))  # measured, 300x -- but no engine reported its prefill yet
    g.gate.session_ended(outcome(0.0))
    assert g.gate.ratio() is None and g.gate.admits()
    w = ReadCostModel(5 * MS, 1 * MS)  # writes alone (no read measured): not evidence either
    w.observe_write(4, 0.4)
    g = Gate(w)
    g.gate.session_ended(outcome(0.1 * MS))
    assert w.estimate().measured and g.gate.ratio() is None and g.gate.admits()
    assert not g.calls and g.gate.closings == 0


def test_it_closes_above_the_bound_and_reopens_only_below_the_hysteresis():
    g = Gate(measured_model(10 * MS))
    gate = g.gate
    read = g.model.estimate().s_per_block

    def at(ratio):  # an engine whose prefill makes the ratio this
        gate.session_ended(outcome(read / ratio))

    at(10.0)  # at the bound: open
    assert gate.ratio() == pytest.approx(10.0) and gate.admits()
    at(10.5)
    assert not gate.admits() and gate.closings == 1 and gate.stats()["open"] is False
    g.clock.t += 2.0
    assert gate.stats()["closed_s"] == pytest.approx(2.0)
    at(9.0)  # below the bound but above the hysteresis: still closed
    assert not gate.admits()
    gate.session_ended(outcome(0.0))  # an engine that reports nothing changes nothing
    assert not gate.admits() and gate.ratio() == pytest.approx(9.0)
    at(REOPEN * 10 * 1.01)
    assert not gate.admits()
    g.clock.t += 1.0
    at(REOPEN * 10 * 0.999)  # at REOPEN x the bound: open again
    assert gate.admits() and gate.closings == 1 and gate.stats()["closed_s"] == 0.0
    assert gate.stats()["paused_s"] == pytest.approx(3.0)  # (2 s, then 1 s more before it reopened)
    at(10.0)
    assert gate.admits()  # (open: only above the bound does it close)
    at(10.01)
    assert not gate.admits() and gate.closings == 2
    g.clock.t += 0.5
    assert gate.stats()["paused_s"] == pytest.approx(3.5) and gate.stats()["closed_s"] == pytest.approx(0.5)


@pytest.mark.parametrize("why", ["always", "no_remeasure"])
def test_it_never_closes_when_told_to_always_write_or_when_it_could_not_remeasure(why):
    g = Gate(measured_model(30 * MS), max_ratio=0.0 if why == "always" else 10.0, remeasure=why == "always")
    g.gate.session_ended(outcome(0.01 * MS))  # 3000x
    for _ in range(3):
        g.clock.t += 60
        assert g.gate.admits()
    assert g.gate.closings == 0 and not g.calls


def test_while_closed_a_refused_store_remeasures_the_tier_at_most_every_recalibrate_s():
    g = Gate(measured_model(30 * MS), recalibrate_s=30.0)
    g.gate.session_ended(outcome(1 * MS))  # 30x
    t0 = g.clock.t
    assert not g.gate.admits() and not g.calls  # the evidence that closed it is fresh
    g.clock.t = t0 + 29.9
    assert not g.gate.admits() and not g.calls
    g.clock.t = t0 + 30.0
    assert not g.gate.admits() and g.calls == [t0 + 30.0] and g.gate.remeasures == 1
    g.clock.t = t0 + 45.0
    assert not g.gate.admits() and len(g.calls) == 1
    g.can = False  # one still running (or none possible): asked again at the next refused store
    g.clock.t = t0 + 61.0
    assert not g.gate.admits() and g.calls[-1] == t0 + 61.0 and g.gate.remeasures == 1
    g.can = True
    g.clock.t = t0 + 62.0
    assert not g.gate.admits() and g.calls[-1] == t0 + 62.0 and g.gate.remeasures == 2
    # the tier got faster: the next measurement's reads (a new regime) reopen it at the next store
    g.model.observe(1, 1 * MS + 0.5 * MS)
    g.model.observe(4, 1 * MS + 2 * MS)
    assert g.gate.admits() and g.gate.ratio() < REOPEN * 10
    g.clock.t += 100.0
    assert g.gate.admits() and len(g.calls) == 3  # open: nothing re-measured


def test_bad_bounds_are_refused():
    m = measured_model(MS)
    for ratio, every in ((-1.0, 30.0), (10.0, 0.0), (10.0, -1.0)):
        with pytest.raises(ValueError):
            WriteBehindGate(m.estimate, ratio, every, remeasure=lambda: True)


# -- the calibration it re-runs, on a real tier (the tier contract's harness: file store, real lanes) --


def test_the_calibration_runs_again_with_the_same_keys_one_run_at_a_time(tmp_path):
    rt = RealHarness(tmp_path, [])
    ended = []
    try:
        cal = Calibration(rt.tier, 3, on_done=ended.append)
        assert cal.start() and cal.running and cal.runs == 1
        assert not cal.start() and cal.runs == 1  # one at a time
        rt.settle(lambda: bool(ended))
        assert ended == [True] and cal.result["state"] == "done" and rt.tier.cost.samples == 2
        files = sorted(p.name for p in (tmp_path / "l3").rglob("*") if p.is_file())
        assert cal.start() and cal.result == {"state": "running", "run": 2}
        rt.settle(lambda: len(ended) == 2)
        assert ended == [True, True] and cal.result["state"] == "done" and rt.tier.cost.samples == 4
        # the same scratch objects, overwritten: a re-measurement leaves nothing new in L3
        assert sorted(p.name for p in (tmp_path / "l3").rglob("*") if p.is_file()) == files
    finally:
        rt.close()


def test_a_calibration_whose_mapping_the_backend_refused_never_runs(tmp_path):
    rt = RealHarness(tmp_path, [])
    ended = []

    def refuse(address, size):
        raise RuntimeError("no more registered memory")

    try:
        rt.backend.register_pool = refuse
        cal = Calibration(rt.tier, 2, on_done=ended.append)
        assert not cal.start() and ended == [False] and cal.result["state"] == "failed"
        assert rt.tier.counters["calibration_failed"] == 1
        assert not cal.start() and ended == [False] and cal.runs == 0  # not tried again
    finally:
        rt.close()
