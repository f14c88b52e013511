"""cost_aware's ETA through genuine SGLang, TP=2 (two spawned ranks, ``eta_workers.py``):

* SGLang's ``load_plugins()`` applies the BEFORE hook on ``Scheduler.get_new_batch_prefill``
  and the plugin sees it applied (what ``activate`` checks at start for ``cost_aware``);
* SGLang's genuine method, called with genuine ``Req`` objects in the waiting queue, runs the
  hook and then SGLang's own code (the batch builder stand-in returns no batch);
* both ranks compute the same tokens ahead for every request although their wall-clock
  prefill accounting differs; only rank 0 sends, and it sends only material moves;
* the updates reach the requests' live cost_aware sessions (the sidecar answers their state);
* afterwards the sidecar holds no lease, pin or staging.
"""

from __future__ import annotations


import pytest

pytest.importorskip("sglang")

from kvsidecar.sidecar.l3.master import free_port  # noqa: E402

from . import eta_workers as E  # noqa: E402
from . import plugin_workers as W  # noqa: E402
from .test_plugin_controller import sidecar_overrides  # noqa: E402

pytestmark = pytest.mark.sglang


def test_eta_hook_tp2(sidecar_factory, instance, tmp_path):
    sidecar_factory(**{**sidecar_overrides(tmp_path), "l3.latency_ms": 150.0})  # sessions stay live a while
    port = free_port()
    out = W.run_ranks(E.rank_main, instance, port)
    r0, r1 = out
    for r in out:
        assert r["eta_hook_applied"] and all(r["hooks"].values()), r
        assert r["plans"] == [None] * 7  # SGLang's own method ran after the hook, every call
        # one cost_aware session per request (how much it restores is the sidecar's decision)
        assert all(v["policy"] == "cost_aware" for v in r["views"]), r["views"]
        assert all(0 <= h <= E.PAGES for h in r["hits"]), r["hits"]
    assert r0["hits"] == r1["hits"]  # one session answers both ranks
    # identical on every rank: the same tokens ahead of every request, iteration by iteration
    t = E.PAGES * 16
    assert r0["history"] == r1["history"] == [
        [[f"eta-req-{i}", i * t] for i in range(E.REQS)],
        [[f"eta-req-{i}", i * t] for i in range(E.REQS)],
        [["eta-req-1", 0], ["eta-req-2", t]],
        [["eta-req-1", 2 * t], ["eta-req-2", 3 * t]]]
    # queue entry: each request waits for the ones queued before it, at SGLang's rate
    rate0 = E.BUSY_US * 1e-6 / 1024
    assert r0["queue_entry_eta"] == pytest.approx([i * t * rate0 for i in range(E.REQS)])
    # rank 0 alone sends, only material moves: nothing while the queue stands still; after the
    # first prefill (0.3 s later, a new rate) request 2; with a chunked prefill ahead, both
    rate1 = (E.BUSY_US + 300_000) * 1e-6 / (1024 + t)
    assert r1["counters"].get("sent", 0) == 0 and not r1["sent_log"]
    # (and at the first iteration, what each request's prefill holds up: ``waiting``, the requests
    # behind it that do not share its first page; at queue entry nobody was behind it)
    sent = [(rid, eta, w) for rid, eta, w, _state in r0["sent_log"]]
    assert sent == [("eta-req-0", 0.0, 2),
                    ("eta-req-1", pytest.approx(t * rate0, abs=1e-6), 1),
                    ("eta-req-2", pytest.approx(t * rate1, abs=1e-6), 0),
                    ("eta-req-1", pytest.approx(2 * t * rate1, abs=1e-6), 1),
                    ("eta-req-2", pytest.approx(3 * t * rate1, abs=1e-6), 0)], sent
    assert r0["counters"]["sent"] == r0["counters"]["planned"] == 5
    assert all(state not in ("unknown", "unavailable") for *_, state in r0["sent_log"]), r0["sent_log"]
    books = r0["books"]
    assert books == {"invariants": "", "leases_live": 0, "pinned": 0, "session_staging": 0}, books
