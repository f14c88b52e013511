"""RequestEnds: a rank's end of a request lasts until its next prefetch, its TTL or its group."""

from kvsidecar.sidecar.kv.decisions import DecisionBook
from kvsidecar.sidecar.kv.request_ends import RequestEnds

K = ("g", "r", 0)


def test_end_start_and_expiry():
    e = RequestEnds(ttl_s=10.0)
    e.end(K, 1, now=0.0)
    e.end(K, 0, now=5.0)  # (renews the record's expiry)
    assert e.ended(K) == {0, 1} and e.ended(("g", "r", 1)) == frozenset() and e.ended(("h", "r", 0)) == frozenset()
    e.start(K, 1)
    assert e.ended(K) == {0}
    assert e.next_expiry() in (10.0, 15.0)  # (a renewed deadline leaves its first entry: an early wake)
    assert e.expire(14.9) == 0 and e.ended(K) == {0}
    assert e.expire(15.0) == 1 and e.ended(K) == frozenset() and e.next_expiry() is None
    e.start(K, 0)  # (nothing to lift: a no-op)
    assert e.records == {}


def test_forget_group_and_last_start_drop_the_record():
    e = RequestEnds(ttl_s=10.0)
    e.end(K, 1, now=0.0)
    e.end(("h", "r", 0), 1, now=0.0)
    e.forget_group("g")
    assert e.ended(K) == frozenset() and e.ended(("h", "r", 0)) == {1}
    e.start(("h", "r", 0), 1)
    assert e.records == {} and e.next_expiry() is None


def test_decisions_skip_marks_only_the_requests_unread_records():
    b = DecisionBook(ttl_s=30.0)
    b.record(("g", "get", "r", 0, 1), 0, 2, {"lease": 7}, 0.0)
    b.record(("g", "get", "r", 0, 2), 1, 2, {"lease": 8}, 0.0)  # rank 1 decided (read) it
    b.record(("g", "get", "r", 1, 1), 0, 2, {"lease": 9}, 0.0)  # another attempt
    b.record(("g", "store", "r", 0, 1), 0, 2, {"staging": 3}, 0.0)  # another op
    b.record(("h", "get", "r", 0, 1), 0, 2, {"lease": 5}, 0.0)  # another group
    skipped = b.skip("g", "get", "r", 0, 1)
    assert [rec.result["lease"] for rec in skipped] == [7]
    assert ("g", "get", "r", 0, 1) not in b.records  # every rank has now "read" it
    assert set(b.records) == {("g", "get", "r", 0, 2), ("g", "get", "r", 1, 1), ("g", "store", "r", 0, 1),
                              ("h", "get", "r", 0, 1)}
    assert b.skip("g", "get", "r", 0, 1) == []  # idempotent


def _index_matches(b: DecisionBook) -> None:
    want = {}
    for key in b.records:
        want.setdefault((key[0], key[2], key[3]), set()).add(key)
    assert b._by_request == want


def test_the_request_index_follows_every_way_a_record_goes():
    b = DecisionBook(ttl_s=10.0)
    for step in range(3):
        b.record(("g", "get", "r", 0, step), 0, 2, {"lease": step}, float(step))
    b.record(("g", "lookup", "r", 0, 0), 0, 2, {"hit": 1}, 0.0)
    b.record(("h", "get", "r", 0, 0), 0, 2, {"lease": 9}, 0.0)
    _index_matches(b)
    b.lookup(("g", "get", "r", 0, 0), 1)  # read by both: gone
    _index_matches(b)
    assert sorted(r.key for r in b.skip("g", "get", "r", 0, 1)) == [("g", "get", "r", 0, 1), ("g", "get", "r", 0, 2)]
    assert b.skip("g", "get", "r", 0, 1) == []  # (both now read by both ranks: gone)
    _index_matches(b)
    assert b.expire(20.0) == 2  # the lookup's and h's
    _index_matches(b)
    b.record(("h", "get", "r", 0, 1), 0, 2, {"lease": 9}, 30.0)
    b.forget_group("h")
    assert b.records == {} and b._by_request == {}


def test_renew_keeps_the_marks_while_others_fetch():
    e = RequestEnds(ttl_s=10.0)
    e.end(K, 1, now=0.0)
    e.renew(K, now=8.0)
    e.renew(("g", "other", 0), now=8.0)  # (no mark: nothing to renew)
    assert e.expire(12.0) == 0 and e.ended(K) == {1}
    assert e.expire(18.0) == 1 and e.records == {}


def test_a_renewed_record_expires_once():
    e = RequestEnds(ttl_s=1.0)
    e.end(K, 1, now=0.0)
    e.end(K, 0, now=0.5)  # two heap entries for the key, both due by 2.0
    assert e.expire(2.0) == 1


def test_skip_in_a_group_of_three_leaves_the_record_for_the_rank_still_to_read():
    b = DecisionBook(ttl_s=30.0)
    key = ("g", "get", "r", 0, 1)
    b.record(key, 0, 3, {"lease": 7}, 0.0)
    assert [r.key for r in b.skip("g", "get", "r", 0, 2)] == [key]
    assert b.has_read(key, 2) and not b.has_read(key, 1) and key in b.records
    assert b.lookup(key, 1) is not None and key not in b.records
    _index_matches(b)
