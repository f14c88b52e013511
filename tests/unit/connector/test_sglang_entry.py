"""cost_aware's decision at queue entry (connector/sglang_entry.py): when the gate runs is a pure
function of the call, so every SPMD rank runs it (and its collective) for the same requests.  The
decision itself runs against a real sidecar in tests/integration/test_backend_seam.py and inside
genuine SGLang in tests/sglang/test_full_server.py."""

from __future__ import annotations

import types

import pytest

from kvsidecar.connector.sglang_entry import EntryGate, gate_applies


@pytest.mark.parametrize("n, page, threshold, hit_end, want", [
    (256, 16, 256, None, True),  # exactly SGLang's threshold
    (255, 16, 256, None, False),  # page-aligned to 240: SGLang declines it as too short
    (271, 16, 256, None, True),
    (2176, 16, 256, None, True),
    (2176, 16, 256, 1024, False),  # SGLang's re-query after a device-hit loss keeps its own path
    (8, 16, 0, None, False),  # less than a page: nothing to fetch
    (16, 16, 0, None, True),
    (100, 0, 0, None, False),  # no page size: never
])
def test_gate_applies_exactly_where_sglang_would_query(n, page, threshold, hit_end, want):
    assert gate_applies(n, page, threshold, hit_end) is want


class _Backend:
    def __init__(self, answer):
        self.answer, self.ended, self.counts = answer, [], {}
        self.trace = None

    def _count(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1

    def start_at_entry(self, rid, attempt, keys, eta_s, per_block):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def end(self, rid, attempt=0):
        self.ended.append((rid, attempt))


class _Cache:
    """Single rank (no collective); the keys come from a stub of the gate's ``keys``."""
    tp_world_size = 1

    def __init__(self):
        self.ongoing_prefetch = {}
        self.storage_prefetch_retries = types.SimpleNamespace(_pending={})


class _Handle:
    """SGLang's ``CacheRequestHandle``: hashable (a key of ``ongoing_prefetch``)."""

    def __init__(self, rid, attempt_id=0):
        self.rid, self.attempt_id = rid, attempt_id


def _gate(answer):
    g = EntryGate(_Backend(answer))
    g.keys = lambda *a: ["k0", "k1"]
    return g


def test_a_session_with_nothing_to_restore_skips_the_operation_and_is_ended():
    g, req = _gate(False), _Handle("r", 2)
    assert g.decide(_Cache(), req, [1] * 32, None, None, None, 0.0, 1e-3) is False
    assert g.backend.ended == [("r", 2)] and g.backend.counts == {"entry_asked": 1, "entry_skipped": 1}


def test_a_failing_answer_runs_the_operation():
    g, req = _gate(RuntimeError("boom")), _Handle("r")
    assert g.decide(_Cache(), req, [1] * 32, None, None, None, 0.0, 1e-3) is True
    assert g.backend.ended == [] and g.backend.counts["entry_errors"] == 1


def test_after_sglangs_own_decline_the_entry_session_is_ended_unless_a_retry_is_armed():
    g, req, cache = _gate(True), _Handle("r"), _Cache()
    cache.storage_prefetch_retries._pending["r"] = object()
    g.after_prefetch(cache, req)  # a retry will query it (and join the session)
    assert g.backend.ended == []
    cache.storage_prefetch_retries._pending.clear()
    cache.ongoing_prefetch[req] = object()
    g.after_prefetch(cache, req)  # SGLang started its operation: its own lifecycle ends it
    assert g.backend.ended == []
    cache.ongoing_prefetch.clear()
    g.after_prefetch(cache, req)
    assert g.backend.ended == [("r", 0)] and g.backend.counts["entry_ended_unsubmitted"] == 1
