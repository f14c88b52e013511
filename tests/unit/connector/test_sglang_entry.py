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
    """Answers per rid (a dict), or raises when its round is read; records what was sent (at
    entry), what each drain read, and what was ended."""

    def __init__(self, answer):
        self.answer, self.ended, self.counts, self.sent, self.asked = answer, [], {}, [], []
        self.trace = None

    def _count(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1

    def entry_round(self):
        return _Round(self)

    def end(self, rid, attempt=0):
        self.ended.append((rid, attempt))


class _Round:
    """``EntryRound``'s contract over :class:`_Backend`: a slot per send (no start for no keys),
    every start read at ``answers()``, a withdrawn slot's answer True."""

    def __init__(self, backend):
        self.b, self.slots, self.withdrawn = backend, [], set()

    def send(self, rid, attempt, keys, eta_s, per_block):
        if keys:
            self.b.sent.append(rid)
        self.slots.append(rid if keys else None)
        return len(self.slots) - 1

    def withdraw(self, slot):
        self.withdrawn.add(slot)

    @property
    def pending(self):
        return len(self.slots)

    def answers(self):
        slots, withdrawn, self.slots, self.withdrawn = self.slots, self.withdrawn, [], set()
        self.b.asked.append([rid for rid in slots if rid is not None])
        if isinstance(self.b.answer, Exception):
            raise self.b.answer
        return [True if rid is None or i in withdrawn else self.b.answer[rid] for i, rid in enumerate(slots)]


class _Cache:
    """One rank; ``others``: the other ranks' answers the group's MAX meets (None: TP 1)."""

    def __init__(self, others=None):
        self.ongoing_prefetch = {}
        self.storage_prefetch_retries = types.SimpleNamespace(_pending={})
        self.others = others
        self.tp_world_size = 1 if others is None else 2
        self.collectives = []

    def _all_reduce_attn_groups(self, tensor, op):
        self.collectives.append(tensor.tolist())
        for i, x in enumerate(self.others):
            tensor[i] = max(int(tensor[i]), x)


class _Handle:
    """SGLang's ``CacheRequestHandle``: hashable (a key of ``ongoing_prefetch``)."""

    def __init__(self, rid, attempt_id=0):
        self.rid, self.attempt_id = rid, attempt_id


def _gate(answer):
    g = EntryGate(_Backend(answer))
    g.keys = lambda *a: ["k0", "k1"]
    return g


def _defer(g, cache, rids, ran, released=None):
    """Defers each request; ``ran`` gets the rids whose SGLang call ran, ``released`` those whose
    anchor hold ended without one (skipped or dropped)."""
    handles = [_Handle(rid, 2) for rid in rids]
    for h in handles:
        g.defer(cache, h, [1] * 32, None, None, None, 0.0, 1e-3, lambda h=h: ran.append(h.rid),
                (lambda h=h: released.append(h.rid)) if released is not None else (lambda: None))
    return handles


def _drain(g, cache, others_skip=None):
    """One drain as the plugin runs it: ask, SGLang's ready-count sync (a MIN over the group, the
    other rank's "skip" flags ``others_skip`` riding it), then the decisions."""
    import torch

    g.ask()
    extra = g.ride(torch.distributed.ReduceOp.MIN)
    if extra is not None:
        flags = extra.tolist() if others_skip is None else [min(a, b) for a, b in zip(extra.tolist(), others_skip)]
        cache.collectives.append(("sglang-min", extra.tolist()))
        g.rode(torch.tensor(flags))
    g.decide(cache)


def test_the_requests_of_one_iteration_are_decided_in_one_round_riding_sglangs_collective():
    g, ran, released = _gate({"a": False, "b": True, "c": False}), [], []
    cache = _Cache(others=[0, 0, 0])
    _defer(g, cache, ["a", "b", "c"], ran, released)
    assert g.backend.sent == ["a", "b", "c"]  # each start goes out at its queue entry ...
    assert ran == [] and g.backend.asked == [] and g.pending == 3  # ... and is read at the drain
    _drain(g, cache, others_skip=[1, 1, 1])
    assert g.backend.asked == [["a", "b", "c"]] and cache.collectives == [("sglang-min", [1, 0, 1])]
    assert ran == ["b"] and g.backend.ended == [("a", 2), ("c", 2)] and g.pending == 0
    assert released == ["a", "c"]  # the skipped ones' anchor holds end (the run one's: in its call)
    assert g.backend.counts == {"entry_asked": 3, "entry_skipped": 2}
    _drain(g, cache)  # nothing deferred: no round, nothing rides (every rank alike)
    assert len(g.backend.asked) == 1 and len(cache.collectives) == 1


def test_another_ranks_run_keeps_the_operation_on_every_rank():
    g, ran = _gate({"a": False, "b": False}), []
    cache = _Cache(others=[1, 0])
    _defer(g, cache, ["a", "b"], ran)
    _drain(g, cache, others_skip=[0, 1])  # the other rank's sidecar answer (or failure) said run for "a"
    assert ran == ["a"] and g.backend.ended == [("b", 2)] and g.backend.counts["entry_kept_by_group"] == 1


def test_without_a_collective_to_ride_the_group_agrees_in_its_own():
    import torch

    g, ran = _gate({"a": False, "b": False}), []
    cache = _Cache(others=[1, 0])
    _defer(g, cache, ["a", "b"], ran)
    g.ask()
    assert g.ride(torch.distributed.ReduceOp.SUM) is None  # not a reduction the flags can ride
    g.decide(cache)
    assert cache.collectives == [[0, 0]] and ran == ["a"] and g.backend.counts["entry_own_collectives"] == 1
    assert g.ride(torch.distributed.ReduceOp.MAX) is None  # decided: nothing rides later collectives


def test_flags_ride_a_max_as_run():
    import torch

    g, ran, cache = _gate({"a": False, "b": True}), [], _Cache(others=[0, 0])
    _defer(g, cache, ["a", "b"], ran)
    g.ask()
    extra = g.ride(torch.distributed.ReduceOp.MAX)
    assert extra.tolist() == [0, 1]
    g.rode(torch.tensor([1, 1]))  # another rank runs "a"
    g.decide(cache)
    assert ran == ["a", "b"] and cache.collectives == []


def test_a_failing_round_runs_every_operation():
    g, ran = _gate(RuntimeError("boom")), []
    cache = _Cache()
    _defer(g, cache, ["a", "b"], ran)
    _drain(g, cache)
    assert ran == ["a", "b"] and g.backend.ended == [] and g.backend.counts["entry_errors"] == 1
    assert g.backend.asked == [["a", "b"]]


def test_a_request_without_keys_runs_its_operation_and_is_not_asked_about():
    g, ran, cache = _gate({"b": False}), [], _Cache()

    def keys(cache, tokens, *rest):
        if len(tokens) == 7:
            raise ValueError("bad span")
        return ["k0"]

    g.keys = keys
    g.defer(cache, _Handle("a"), [1] * 7, None, None, None, None, None, lambda: ran.append("a"))
    g.defer(cache, _Handle("b"), [1] * 32, None, None, None, None, None, lambda: ran.append("b"))
    _drain(g, cache)
    assert g.backend.asked == [["b"]] and ran == ["a"] and g.backend.ended == [("b", 0)]
    assert g.backend.counts["entry_errors"] == 1


def test_a_request_aborted_before_its_decision_is_never_run_and_its_session_is_ended_at_the_drain():
    g, ran, released, cache = _gate({"a": True, "b": True}), [], [], _Cache()
    a, _b = _defer(g, cache, ["a", "b"], ran, released)
    assert g.drop(a) is True and g.drop(a) is False and released == ["a"]
    assert g.backend.ended == []  # not before its start's answer is read (the end must not overtake it)
    _drain(g, cache)
    assert g.backend.asked == [["a", "b"]] and ran == ["b"] and g.backend.counts["entry_dropped"] == 1
    assert released == ["a"] and g.backend.ended == [("a", 2)]


def test_a_drop_alone_still_ends_its_session_at_the_next_drain():
    g, ran, cache = _gate({"a": False}), [], _Cache(others=[0])
    (a,) = _defer(g, cache, ["a"], ran)
    g.drop(a)
    _drain(g, cache)
    assert g.backend.asked == [["a"]] and g.backend.ended == [("a", 2)] and ran == []
    assert cache.collectives == []  # nothing left to decide: no flags ride, no collective of its own


def test_the_same_request_deferred_twice_is_decided_once():
    g, ran, cache = _gate({"a": True}), [], _Cache()
    h, released = _Handle("a", 2), []
    g.defer(cache, h, [1] * 32, None, None, None, 0.0, 1e-3, lambda: ran.append("h1"), lambda: released.append("h1"))
    g.defer(cache, h, [1] * 32, None, None, None, 0.0, 1e-3, lambda: ran.append("h2"), lambda: released.append("h2"))
    _drain(g, cache)
    assert ran == ["h2"] and released == ["h1"]  # the first call's hold ended when it was replaced
    assert g.backend.sent == ["a", "a"] and g.backend.ended == []  # (the second start joins the first)


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
