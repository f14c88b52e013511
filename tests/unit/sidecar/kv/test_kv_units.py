"""Pool, index, leases and staging as plain objects: transitions, eviction, invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.shm.errors import ErrorCode
from kvsidecar.sidecar.kv.index import PoolError, PrefixIndex, pack_ids, unpack_ids
from kvsidecar.sidecar.kv.leases import LeaseError, LeaseTable
from kvsidecar.sidecar.kv.admission import PoolManager, Refusal
from kvsidecar.sidecar.kv.staging import StagingTable


def key(*path) -> bytes:
    return ("/".join(map(str, path))).encode().ljust(16, b".")[:16]


def chain(prefix: str, n: int) -> bytes:
    return b"".join(key(prefix, i) for i in range(n))


def make(n=8):
    index = PrefixIndex(n, 100)
    leases = LeaseTable(index)
    pool = PoolManager(index, leases, reserved_limit_bytes=n * 100, pinned_limit_bytes=n * 100)
    staging = StagingTable(pool)
    return pool, index, leases, staging


def stage(pool, ch: bytes, *, now=0.0, ttl=10.0, limit=None):
    return pool.prepare_stage(ch, pool.index.match(ch), limit, "store", prefix_ttl_s=ttl, owner=("store", "g"), now=now)


def publish_chain(pool, index, ch: bytes, start_parent=-1):
    blocks = unpack_ids(index.alloc(len(ch) // 16))
    parent = start_parent
    for i, b in enumerate(blocks):
        index.publish(ch[i * 16:(i + 1) * 16], b, parent)
        parent = b
    return list(blocks)


def counts(index):
    return (index.free, index.staged, index.resident, index.pinned)


def test_pool_transitions_and_check():
    index = PrefixIndex(4, 10)
    a, b = unpack_ids(index.alloc(2))
    assert counts(index) == (2, 2, 0, 0)
    index.publish(key("a"), a, -1)
    index.release_staging(b)
    with pytest.raises(PoolError):
        index.publish(key("b"), b, -1)  # FREE, not STAGING
    c = unpack_ids(index.alloc(1))[0]
    with pytest.raises(PoolError):
        index.publish(key("c"), c, 3)  # parent not resident
    with pytest.raises(PoolError):
        index.publish(key("a"), c, -1)  # key already resident
    index.release_staging(c)
    assert index.pin(pack_ids([a, a])) == 1 and index.refcount(a) == 2
    assert index.evict(5) == 0  # pinned: not evictable
    index.unpin(pack_ids([a, a]))
    with pytest.raises(PoolError):
        index.unpin(pack_ids([a]))
    with pytest.raises(PoolError):
        index.pin(pack_ids([b]))  # not resident
    assert index.check() == ""
    assert index.evict(5) == 1 and counts(index) == (4, 0, 0, 0)
    assert len(index.alloc(10)) == 16 and index.free == 0


def test_eviction_takes_leaves_lru_first_and_never_leaves_holes():
    pool, index, leases, _ = make(8)
    c1 = chain("a", 4)
    b1 = publish_chain(pool, index, c1)
    # a second chain sharing the first two blocks of c1
    c2 = c1[:32] + chain("b", 2)
    blocks2 = unpack_ids(index.alloc(2))
    index.publish(c2[32:48], blocks2[0], b1[1])
    index.publish(c2[48:64], blocks2[1], blocks2[0])
    assert index.check() == ""
    assert index.match(c1) == 4 and index.match(c2) == 4
    index.touch(pack_ids(b1))  # chain a is more recent than chain b
    assert index.evict(1) == 1
    assert index.match(c2) == 3 and index.match(c1) == 4  # b's leaf went first
    lease = leases.new(pack_ids(b1), ttl_s=10, now=0, kind="get", owner=(0, 1))
    assert index.evict(10) == 1  # only chain b's remaining block; chain a is pinned
    assert index.match(c1) == 4 and index.match(c2) == 2
    leases.drop(lease, "released")
    assert index.evict(10) == 4
    assert index.match(c1) == 0
    assert index.check() == ""


def test_lease_release_rules():
    pool, index, leases, _ = make(4)
    blocks = pack_ids(publish_chain(pool, index, chain("x", 2)))
    plain = leases.new(blocks, ttl_s=5, now=0, kind="get", owner=(1, 7))
    with pytest.raises(LeaseError) as ei:
        leases.release(plain.id, (2, 9), "g", 0)
    assert ei.value.code == ErrorCode.NOT_OWNER
    assert leases.release(plain.id, (1, 7), "g", 0) is True
    assert leases.release(plain.id, (1, 7), "g", 0) is False  # idempotent
    with pytest.raises(LeaseError) as ei:
        leases.release(12345, (1, 7), "g", 0)
    assert ei.value.code == ErrorCode.UNKNOWN_ID
    grp = leases.new(blocks, ttl_s=5, now=0, kind="get", group="g", holders=range(2))
    with pytest.raises(LeaseError):
        leases.release(grp.id, (3, 3), "other", 0)
    assert leases.release(grp.id, (1, 7), "g", 0)
    assert index.refcount(unpack_ids(blocks)[0]) == 1
    assert leases.release(grp.id, (1, 7), "g", 0) is False
    assert leases.client_gone((2, 2), "g", 1) == 1  # the other rank dies: lease dropped
    assert index.pinned == 0
    g2 = leases.new(blocks, ttl_s=5, now=0, kind="get", owner=(1, 7))
    assert leases.reap(4.9) == 0 and leases.reap(5.0) == 1
    assert g2.id not in leases.leases and index.pinned == 0
    assert index.check() == ""


def test_staging_publish_abort_and_writer_death():
    pool, index, leases, staging = make(8)
    c = chain("s", 4)
    head = publish_chain(pool, index, c[:16])
    plan = stage(pool, c)
    assert plan.start == 1 and plan.count == 3 and plan.parent == head[0] and plan.prefix_lease is not None
    st = staging.open(plan, group="g", writers={0, 1}, ttl_s=10, now=0)
    assert index.match(c) == 1
    assert not staging.commit(st, 0)
    assert index.match(c) == 1  # not published until every writer committed
    assert staging.commit(st, 1)
    assert index.match(c) == 4 and index.pinned == 0  # the prefix lease went with the plan
    st2 = staging.open(stage(pool, chain("t", 2)), group="g", writers={0, 1}, ttl_s=10, now=0)
    staging.commit(st2, 0)
    assert staging.client_gone("g", 1) == 1  # rank 1 died before committing: nothing published
    assert index.match(chain("t", 2)) == 0 and index.staged == 0
    st3 = staging.open(stage(pool, chain("u", 1)), group="g", writers={0}, ttl_s=1, now=0)
    assert staging.reap(1.0) == 1 and st3.id not in staging.records
    assert index.check() == ""


def test_pool_manager_prepare_complete_abandon():
    pool, index, leases, staging = make(8)
    a = chain("a", 6)
    plan = stage(pool, a)
    assert plan.count == 6 and index.staged == 6
    # a second writer of the same chain stops at the keys already staging: an empty plan
    assert stage(pool, a).count == 0
    # a failed block cuts the prefix there; the rest is freed, never published
    assert pool.complete(plan, [True, True, False, True, True, True]) == 2
    assert index.match(a) == 2 and index.staged == 0
    with pytest.raises(ValueError):
        pool.complete(plan, [True] * 6)  # exactly once
    p2 = stage(pool, a, limit=2)  # from the resident prefix, at most 2 blocks
    assert (p2.start, p2.count) == (2, 2) and p2.prefix_lease is not None and index.pinned == 2
    pool.abandon(p2)
    assert index.match(a) == 2 and index.staged == 0 and index.pinned == 0
    # limits: reserved room, then the allocator (everything pinned)
    small = PoolManager(index, leases, reserved_limit_bytes=300, pinned_limit_bytes=800)
    p3 = small.prepare_stage(chain("b", 5), 0, None, "store", prefix_ttl_s=1, owner=("s", "g"), now=0)
    assert p3.count == 3  # only 3 blocks of room
    r = small.prepare_stage(chain("c", 2), 0, None, "store", prefix_ttl_s=1, owner=("s", "g"), now=0)
    assert isinstance(r, Refusal) and r.resource == "reserved" and r.code == ErrorCode.LIMIT
    small.abandon(p3)
    held = leases.new(index.resident_ids(a, 2), ttl_s=10, now=0, kind="get", owner=(0, 0))
    full = stage(pool, chain("d", 6))
    assert full.count == 6  # 6 free blocks
    r = stage(pool, chain("e", 1))
    assert isinstance(r, Refusal) and r.resource == "allocator"  # the other 2 are pinned
    assert pool.refusals == {"allocator": 1} and small.refusals == {"reserved": 1}
    pool.abandon(full)
    leases.drop(held, "released")
    assert index.check() == "" and index.pinned == 0 and index.staged == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "get", "release", "evict", "abort", "reap"]),
                          st.integers(0, 5), st.integers(1, 6)), max_size=60))
def test_random_operations_keep_every_invariant(ops):
    pool, index, leases, staging = make(12)
    live = []
    opened = []
    now = 0.0
    for op, which, n in ops:
        now += 0.1
        c = chain(f"c{which % 3}", n)
        if op == "store":
            plan = stage(pool, c, now=now, ttl=1)
            if isinstance(plan, Refusal) or plan.count == 0:
                continue
            s = staging.open(plan, group="g", writers={0}, ttl_s=1, now=now)
            if which % 2:
                staging.commit(s, 0)
            else:
                opened.append(s)
        elif op == "get":
            m = index.match(c)
            if m:
                live.append(leases.new(index.resident_ids(c, m), ttl_s=1, now=now, kind="get", owner=(0, 0)))
        elif op == "release" and live:
            leases.release(live.pop(which % len(live)).id, (0, 0), None, 0)
        elif op == "evict":
            index.evict(n)
        elif op == "abort" and opened:
            staging.abort(opened.pop(which % len(opened)), "test")
        elif op == "reap":
            now += 1.0
            leases.reap(now)
            staging.reap(now)
        assert index.check() == ""
        pins = leases.pins_per_block()
        assert all(index.refcount(b) == pins.get(b, 0) for b in range(index.num_blocks))
        assert staging.staged_blocks() == index.staged
        # no holes: along every chain, resident blocks form a prefix
        for w in range(3):
            full = chain(f"c{w}", 6)
            m = index.match(full)
            assert all(index.find(full[i * 16:(i + 1) * 16]) < 0 for i in range(m + 1, 6))


def books(pool, index, leases, staging):
    """Every pin is held by a lease or a session hold, every staged block by a plan or a staging."""
    pins = leases.pins_per_block() + pool.pins_per_block()
    assert all(index.refcount(b) == pins.get(b, 0) for b in range(index.num_blocks))
    assert pool.staged_blocks() + staging.staged_blocks() == index.staged == len(index.staging)
    assert pool.check() == "" and index.check() == ""


def test_session_claim_classifies_stages_and_resolves_awaited_blocks():
    from kvsidecar.sidecar.kv.chunks import ChunkKind

    pool, index, leases, staging = make(8)
    ch = chain("s", 4)
    pool.complete(stage(pool, ch, limit=1), [True])  # position 0 resident
    other = staging.open(stage(pool, ch[2 * 16:3 * 16]), group="g", writers={0}, ttl_s=None, now=0)
    # (another writer, an engine store, stages position 2's key)
    hold = pool.open_hold(7, ch, 1)
    assert hold.pins == {0: index.find(key("s", 0))} and index.pinned == 1
    woken = []
    plan = pool.claim(hold, 0, 1, 3, on_shared=woken.append)
    assert plan.kinds == (ChunkKind.OWN, ChunkKind.SHARED, ChunkKind.OWN) and sorted(plan.own_blocks) == [1, 3]
    assert plan.shared_ok == {2: None} and not plan.resolved and pool.awaited(plan) is False
    assert pool.staged_blocks() == 2
    books(pool, index, leases, staging)
    staging.commit(other, 0)  # its writer published it: the waiter is woken, the block pinned for it
    assert woken == [plan] and plan.shared_ok == {2: True} and 2 in hold.pins
    plan.landed([True, True])
    assert plan.resolved and plan.outcome() == (True, True, True)
    assert pool.publish(plan, 3) == 2 and not plan.attached and index.match(ch) == 4
    books(pool, index, leases, staging)
    lease = pool.finish(hold, 4, ("g", "r", 0), retain=True, ttl_s=5, now=0)
    assert lease.count == 4 and pool.result_of(("g", "r", 0), 7) is lease and pool.holds == {}
    assert pool.hand_off(("g", "r", 0)) and not pool.hand_off(("g", "r", 0)) and pool.handoffs == 1
    assert index.pinned == 0
    books(pool, index, leases, staging)


def test_session_claim_stops_short_at_a_limit_and_orphans_resolve():
    index = PrefixIndex(8, 100)
    leases = LeaseTable(index)
    pool = PoolManager(index, leases, reserved_limit_bytes=300, pinned_limit_bytes=800)
    staging = StagingTable(pool)
    ch = chain("t", 6)
    hold = pool.open_hold(1, ch, 0)
    plan = pool.claim(hold, 0, 0, 6, on_shared=None)
    assert plan.count == 3 and pool.refusals == {"reserved": 1}  # 3 blocks of staging room
    r = pool.claim(hold, 1, 3, 3, on_shared=None)
    assert isinstance(r, Refusal) and r.resource == "reserved" and 1 not in hold.plans
    pool.leave_behind(plan, 0)  # the read is still in flight: its blocks stay STAGING as an orphan
    assert (1, 0) in pool.orphans and index.staged == 3
    books(pool, index, leases, staging)
    assert pool.resolve_orphan((1, 0), [True, False, True]) == (1, 2)  # 2 has no resident parent
    assert pool.resolve_orphan((1, 0), [True]) is None and index.match(ch) == 1 and index.staged == 0
    assert pool.finish(hold, 0, ("g", "t", 0), retain=True, ttl_s=5, now=0) is None
    books(pool, index, leases, staging)
