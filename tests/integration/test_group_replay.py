"""Ranks that come back to their TP group never get block ids nobody pins for them (DESIGN §6).

Every case is the public connector API against a real sidecar process, TP=2, and every load is
checked byte for byte: chain A is all 1.0, chain B all 5.0, chain C all 3.0, so a rank that is
handed another chain's blocks copies the wrong value and the test says which.  A replay whose
lease or staging is gone is a *stale miss* (count 0, ``stale``), counted as ``decisions_stale``.
"""

from __future__ import annotations

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.errors import RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.config import ConfigError, load_config
from kvsidecar.sidecar.spawn import SidecarStartError

from ..helpers import wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=2)
N = 8  # blocks per chain


def overrides(num_blocks: int, **extra) -> dict:
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": num_blocks, "l3.backend": "none"})
    d.update(extra)
    return d


def tokens(chain_no: int) -> list:
    return [chain_no * 10_000 + t for t in range(N * LAY.tokens_per_block)]


def kv_of(value: float, pages: int = N) -> list:
    shape = (pages, LAY.tokens_per_block, LAY.heads_per_shard, LAY.head_dim)
    return [tuple(torch.full(shape, value, dtype=torch.float16) for _ in range(2)) for _ in range(LAY.num_layers)]


def rank(instance: str, r: int, group: str = "g") -> KVConnector:
    c = KVConnector(instance, LAY, rank=r, group=group, populate="off", verify_loads="all")
    c.attach()
    return c


def store_group(ranks, chain_no: int, value: float, req: str) -> None:
    """Every rank of a group stores its shard of chain ``chain_no`` (all ``value``)."""
    chain = ranks[0].hasher.chain(tokens(chain_no))
    sts = [c.store(chain, req=req, step=0) for c in ranks]
    assert all(st.count == N for st in sts), [st.count for st in sts]
    for c, st in zip(ranks, sts):
        c.save(st, kv_of(value), list(range(st.count)))
    assert [c.commit(st)["published"] for c, st in zip(ranks, sts)][-1] is True


def loaded_values(c: KVConnector, lease) -> set:
    """The distinct values a load of ``lease`` copies into fresh pages (set() for a miss)."""
    out = kv_of(0.0)
    c.load(lease, out, list(range(lease.count)))
    return {float(v) for layer in out for t in layer for v in t[:lease.count].unique()}


def counters(c: KVConnector) -> dict:
    return c.stats(check=True)


def books_clean(s: dict) -> None:
    assert s["invariants"] == ""
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 and s["pool"]["staging"] == 0, s


def release_check_detach(held, conns) -> None:
    """Release every ``(connector, lease)`` in ``held``, assert the books are empty (read by the
    first of ``conns``), then detach ``conns``."""
    for c, lease in held:
        c.release(lease)
    books_clean(counters(conns[0]))
    for c in conns:
        c.detach()


def test_rank_that_detached_gets_a_stale_miss_not_reused_blocks(sidecar_factory, instance):
    """The issue's five steps: a lease made while rank 1 was away has no share for it."""
    sidecar_factory(**overrides(N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group([r0, r1], 1, 1.0, "store-A")
    r1.detach()  # 2. rank 1 departs
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=1)  # 3. the group's decision, made without rank 1
    assert lease.count == N and loaded_values(r0, lease) == {1.0}
    assert r0.release(lease) is True
    assert r0.flush() == N
    store_group(h, 2, 5.0, "store-B")  # 4. another group reuses the same 8 blocks
    r1.attach()  # 5. rank 1 comes back and replays step 1
    again = r1.get(chain_a, req="r", step=1)
    assert (again.count, again.stale) == (0, True), f"replayed {again.count} blocks of {loaded_values(r1, again)}"
    assert r1.release(again) is False
    s = counters(r0)
    assert s["counters"]["decisions_stale"] == 1
    books_clean(s)
    for c in (r0, r1, *h):
        c.detach()


def test_rank_that_died_holding_an_unread_decision(sidecar_factory, instance):
    """A lease made while rank 1 was there; it dies before reading it (its share is dropped),
    the others release, the blocks are reused; after re-attach the same key is a stale miss."""
    sidecar_factory(**overrides(N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group([r0, r1], 1, 1.0, "store-A")
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=7)
    r1.detach()  # leaves before reading it (a kill -9 does the same through reclaim): share dropped
    assert r0.release(lease) is True
    r0.flush()
    store_group(h, 2, 5.0, "store-B")
    r1.attach()
    again = r1.get(chain_a, req="r", step=7)
    assert (again.count, again.stale) == (0, True), loaded_values(r1, again)
    release_check_detach([], (r0, r1, *h))


def test_rank_back_while_the_lease_lives_joins_it_and_loads_the_right_bytes(sidecar_factory, instance):
    """Rank 1 away when the lease was made, back while rank 0 still holds it: the replay gives it
    a share of the live lease (its blocks stay pinned until it releases too) and the right bytes."""
    sidecar_factory(**overrides(2 * N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    store_group([r0, r1], 1, 1.0, "store-A")
    r1.detach()
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=1)
    r1.attach()
    again = r1.get(chain_a, req="r", step=1)
    assert (again.count, again.stale) == (N, False)
    r0.release(lease)  # rank 0 is done; rank 1's share now keeps the blocks
    assert r0.flush() == 0
    assert loaded_values(r1, again) == {1.0}
    assert r0.stats()["pool"]["pinned"] == N
    assert r1.release(again) is True
    release_check_detach([], (r0, r1))


def test_rank_attaching_late_for_the_first_time(sidecar_factory, instance):
    """Rank 1 of group g never attached when rank 0 decided: its share waits for it, and its
    first ask gets the same blocks with the right bytes (and releasing it empties the books)."""
    sidecar_factory(**overrides(2 * N))
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group(h, 1, 1.0, "store-A")
    r0 = rank(instance, 0)
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=3)
    assert loaded_values(r0, lease) == {1.0}
    r0.release(lease)
    r0.flush()
    store_group(h, 2, 5.0, "store-B")  # needs free blocks: A's stay pinned for rank 1
    r1 = rank(instance, 1)
    again = r1.get(chain_a, req="r", step=3)
    assert again.count == N and loaded_values(r1, again) == {1.0}
    r1.release(again)
    release_check_detach([], (r0, r1, *h))


def test_decisions_may_not_outlive_their_leases(sidecar_factory, instance):
    """``lease_ttl_s`` shorter than ``decision_ttl_s`` let a slow rank's replay point at reaped,
    reused blocks; such a config is refused at start with the fields named."""
    with pytest.raises(ConfigError, match="decision_ttl_s .* must be <= lease_ttl_s"):
        load_config(None, {"limits.lease_ttl_s": 0.3, "limits.decision_ttl_s": 30.0})
    with pytest.raises(ConfigError, match="staging_ttl_s"):
        load_config(None, {"limits.staging_ttl_s": 1.0})
    with pytest.raises(SidecarStartError):
        sidecar_factory(**overrides(N, **{"limits.lease_ttl_s": 0.3, "limits.decision_ttl_s": 30.0}))


def test_lease_expiry_before_the_slow_rank_reads(sidecar_factory, instance):
    """Equal TTLs: the slow rank asks after the lease expired and the blocks were reused; it gets
    a miss (the record expired with the lease, or its replay is stale), never the old ids."""
    sidecar_factory(**overrides(N, **{"limits.lease_ttl_s": 0.5, "limits.decision_ttl_s": 0.5,
                                      "limits.staging_ttl_s": 5.0}))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group([r0, r1], 1, 1.0, "store-A")
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=1)
    r0.release(lease)  # rank 1's share is what the reaper drops
    wait_until(lambda: r0.stats()["leases"]["live"] == 0, 10.0, "the lease expired")
    r0.flush()
    store_group(h, 2, 5.0, "store-B")
    again = r1.get(chain_a, req="r", step=1)
    assert again.count == 0, loaded_values(r1, again)
    release_check_detach([], (r0, r1, *h))


def test_a_new_incarnation_reusing_request_ids_is_answered_afresh(sidecar_factory, instance):
    """The whole group leaves holding a decision one rank had not read; an engine restarted
    under the same group name reuses the request id and step for another chain: it gets its
    own chain's blocks (old records are dropped with the group), never the old incarnation's."""
    sidecar_factory(**overrides(2 * N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group([r0, r1], 1, 1.0, "store-A")
    chain_a = r0.hasher.chain(tokens(1))
    r0.get(chain_a, req="r", step=1)  # rank 1 never reads this decision
    r0.detach(), r1.detach()  # the group leaves: its leases are dropped
    h[0].flush()
    store_group(h, 2, 5.0, "store-B")
    hold_b = [c.get(c.hasher.chain(tokens(2))) for c in h]  # B stays pinned in A's old blocks
    n0, n1 = rank(instance, 0), rank(instance, 1)  # the new incarnation
    store_group([n0, n1], 3, 3.0, "store-C")
    chain_c = n0.hasher.chain(tokens(3))
    got = [c.get(chain_c, req="r", step=1) for c in (n0, n1)]
    assert [g.count for g in got] == [N, N]
    assert [loaded_values(c, g) for c, g in zip((n0, n1), got)] == [{3.0}, {3.0}]
    release_check_detach([*zip((n0, n1), got), *zip(h, hold_b)], (n0, n1, *h))


def test_store_replay_of_an_aborted_staging_writes_nothing(sidecar_factory, instance):
    """Rank 1 leaves before writing its shard (the staging is aborted, its blocks freed and
    reused by another group); back, it replays the store decision: it gets no staging ids —
    writing into them would overwrite the other chain's bytes."""
    sidecar_factory(**overrides(N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    chain_a = r0.hasher.chain(tokens(1))
    st = r0.store(chain_a, req="store-A", step=0)
    r0.save(st, kv_of(1.0), list(range(st.count)))
    r1.detach()  # a writer gone: the staging is aborted
    # (once the sidecar has seen the detach acknowledged: after detach() returns, not before)
    wait_until(lambda: counters(r0)["pool"]["staging"] == 0, 10, "the aborted staging to be freed")
    store_group(h, 2, 5.0, "store-B")  # reuses the freed blocks
    r1.attach()
    again = r1.store(chain_a, req="store-A", step=0)
    assert (again.count, again.stale) == (0, True), again
    chain_b = h[0].hasher.chain(tokens(2))
    leases = [c.get(chain_b) for c in h]
    assert [loaded_values(c, lease) for c, lease in zip(h, leases)] == [{5.0}, {5.0}]
    release_check_detach(zip(h, leases), (r0, r1, *h))


def test_a_rank_with_two_connections_keeps_its_shares_when_one_leaves(sidecar_factory, instance):
    """A host's connection pool gives one rank several clients: one of them leaving must not drop
    the rank's share of a group lease or abort the rank's pending shard of a store (they belong
    to the rank); its last connection leaving does."""
    sidecar_factory(**overrides(2 * N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    r1b = rank(instance, 1)  # a second connection of rank 1 (another thread of the same host)
    store_group([r0, r1], 1, 1.0, "store-A")
    chain_a = r0.hasher.chain(tokens(1))
    lease = r0.get(chain_a, req="r", step=1)  # a share for rank 1 too
    chain_b = r0.hasher.chain(tokens(2))
    st0, st1 = r0.store(chain_b, req="store-B", step=0), r1b.store(chain_b, req="store-B", step=0)
    r1.detach()  # one of rank 1's connections leaves
    r0.release(lease)
    assert r0.flush() == 0  # rank 1's share still pins chain A
    again = r1b.get(chain_a, req="r", step=1)
    assert (again.count, again.stale) == (N, False) and loaded_values(r1b, again) == {1.0}
    r1b.release(again)
    for c, st, v in ((r0, st0, 5.0), (r1b, st1, 5.0)):  # rank 1's pending shard was not aborted
        c.save(st, kv_of(v), list(range(st.count)))
    assert r0.commit(st0)["published"] is False and r1b.commit(st1)["published"] is True
    lease_b = r1b.get(chain_b)
    assert loaded_values(r1b, lease_b) == {5.0}
    release_check_detach([(r1b, lease_b)], (r0, r1b))


def test_a_scan_lease_is_the_groups_get_and_follows_the_same_replay_rule(sidecar_factory, instance):
    """``poll_scan(get=True)`` leases a terminal session exactly as a ``get`` of its chain at the
    scan's step: every rank gets the same blocks and a share of one group lease (each loads its
    own shard's bytes).  A rank that was away when the scan leased, and comes back after that
    lease is gone and its blocks hold another chain, replays the scan as a stale miss."""
    sidecar_factory(**overrides(N, **{"l3.backend": "none"}))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    h = [rank(instance, 0, "h"), rank(instance, 1, "h")]
    store_group([r0, r1], 1, 1.0, "store-A")
    chain_a = r0.hasher.chain(tokens(1))
    for c in (r0, r1):
        assert c.prefetch(chain_a, "r", policy="wait_complete")["state"] == "terminal"  # resident
    leases = []
    for c in (r0, r1):
        (view,) = c.poll_scan([("r", None, True)], step=3, get=True)
        assert view["state"] == "terminal" and view["get"]["count"] == N, view
        leases.append(c.lease_of(view["get"], chain_a))
    assert leases[0].id == leases[1].id and leases[0].blocks == leases[1].blocks
    assert [loaded_values(c, lease) for c, lease in zip((r0, r1), leases)] == [{1.0}, {1.0}]
    for c, lease in zip((r0, r1), leases):
        c.release(lease)
    books_clean(counters(r0))  # one lease, both shares released
    # rank 1 away while rank 0 scans (and leases) request "s"; the blocks are then reused
    r1.detach()
    assert r0.prefetch(chain_a, "s", policy="wait_complete")["state"] == "terminal"
    (view,) = r0.poll_scan([("s", None, True)], step=4, get=True)
    lease = r0.lease_of(view["get"], chain_a)
    assert lease.count == N and loaded_values(r0, lease) == {1.0}
    r0.release(lease)
    assert r0.flush() == N
    store_group(h, 2, 5.0, "store-B")
    r1.attach()
    (view,) = r1.poll_scan([("s", None, True)], step=4, get=True)  # the group's step-4 scan, replayed
    assert view["state"] == "terminal"
    late = r1.lease_of(view["get"], chain_a)
    assert (late.count, late.stale) == (0, True), loaded_values(r1, late)
    assert counters(r0)["counters"]["decisions_stale"] == 1
    release_check_detach([], (r0, r1, *h))


# -- a rank whose engine ended the request (SGLang's terminate_prefetch: each rank's I/O thread
# stops between batches, and which batch is a race between ranks) ------------------------------
def _ended_setup(sidecar_factory, instance):
    sidecar_factory(**overrides(2 * N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    store_group([r0, r1], 1, 1.0, "store-A")
    return r0, r1, r0.hasher.chain(tokens(1))


def test_a_get_after_the_rank_ended_the_request_holds_no_share_for_it(sidecar_factory, instance):
    """Rank 1 ended the request, then rank 0's I/O thread takes the next batch: the lease holds
    no share for rank 1 (which will never release one), so rank 0's release empties the books;
    rank 1's own late GET of that batch is a miss."""
    r0, r1, chain = _ended_setup(sidecar_factory, instance)
    assert r1.abort("r")["state"] == "unknown"  # (no session: the rank is done with it all the same)
    lease = r0.get(chain, req="r", step=4)
    assert lease.count == N and loaded_values(r0, lease) == {1.0}
    late = r1.get(chain, req="r", step=4)
    assert late.count == 0 and r1.release(late) is False
    r0.release(lease)
    s = counters(r0)
    assert s["counters"]["gets_after_end"] == 1
    release_check_detach([], (r0, r1))


def test_a_rank_ending_before_it_reads_the_decision_gives_its_share_up(sidecar_factory, instance):
    """Rank 0 decided the batch with a share for rank 1; rank 1 ends the request before it asks:
    its share goes at once (not at the lease's TTL), and a GET it still sends is a miss."""
    r0, r1, chain = _ended_setup(sidecar_factory, instance)
    lease = r0.get(chain, req="r", step=4)
    r1.abort("r")
    assert r0.release(lease) is True
    assert counters(r0)["counters"]["get_shares_given_up"] == 1
    books_clean(counters(r0))  # (before: N blocks pinned for rank 1 until lease_ttl_s)
    late = r1.get(chain, req="r", step=4)
    assert late.count == 0 and not late.stale
    release_check_detach([], (r0, r1))


def test_a_rank_that_received_its_share_keeps_it_through_its_end(sidecar_factory, instance):
    """Rank 1's scheduler ends the request while its I/O thread still copies the batch it got:
    the blocks stay pinned for it until it releases, and it copies the right bytes."""
    r0, r1, chain = _ended_setup(sidecar_factory, instance)
    lease = r0.get(chain, req="r", step=4)
    mine = r1.get(chain, req="r", step=4)
    assert mine.count == N
    r1.abort("r")
    r0.release(lease)
    assert r0.flush() == 0 and r0.stats()["pool"]["pinned"] == N
    assert loaded_values(r1, mine) == {1.0}
    assert r1.release(mine) is True
    assert counters(r0)["counters"].get("get_shares_given_up", 0) == 0
    release_check_detach([], (r0, r1))


def test_a_new_prefetch_of_the_request_lifts_the_end(sidecar_factory, instance):
    """A rank that ended the request and prefetches it again (a retry under the same id and
    attempt) is answered again: its GETs hold shares as before."""
    r0, r1, chain = _ended_setup(sidecar_factory, instance)
    r1.abort("r")
    with pytest.raises(RemoteError):  # a refused prefetch (unknown policy) does not lift the end
        r1.prefetch(chain, "r", policy="nonesuch")
    r0.prefetch(r0.hasher.chain(tokens(2)), "r2", policy="timeout")
    with pytest.raises(RemoteError):  # nor one over another chain than the session's
        r1.prefetch(chain, "r2", policy="timeout")
    r1.abort("r2")
    assert r1.get(chain, req="r", step=6).count == 0
    r1.prefetch(chain, "r", policy="timeout")
    lease = r0.get(chain, req="r", step=8)
    mine = r1.get(chain, req="r", step=8)
    assert (lease.count, mine.count) == (N, N) and loaded_values(r1, mine) == {1.0}
    r1.abort("r")  # (the session: its result lease goes)
    release_check_detach([(r0, lease), (r1, mine)], (r0, r1))


def test_another_groups_end_and_another_attempt_are_not_this_ones(sidecar_factory, instance):
    """The mark is per (group, request, attempt): rank 1 of group h ending ``r``, or rank 1 of g
    ending attempt 1, leaves g's attempt 0 as it was (rank 1's share held, its GET answered)."""
    r0, r1, chain = _ended_setup(sidecar_factory, instance)
    h1 = rank(instance, 1, "h")
    h1.abort("r")
    r1.abort("r", attempt=1)
    lease = r0.get(chain, req="r", step=2)
    r0.release(lease)
    assert r0.stats()["pool"]["pinned"] == N  # rank 1's share of g's attempt 0 still held
    mine = r1.get(chain, req="r", step=2)
    assert mine.count == N and loaded_values(r1, mine) == {1.0}
    r1.release(mine)
    h1.detach()
    release_check_detach([], (r0, r1))


def test_a_conflicting_replay_gives_the_unreceived_share_back(sidecar_factory, instance):
    """Rank 1 asks rank 0's (req, step) about another chain (a reused request id): a stale miss,
    and the share kept for it goes (it will never release a lease it was not told of); a rank
    that had received its share and then asks again about another chain keeps it until it
    releases."""
    sidecar_factory(**overrides(2 * N))
    r0, r1 = rank(instance, 0), rank(instance, 1)
    store_group([r0, r1], 1, 1.0, "store-A")
    store_group([r0, r1], 2, 5.0, "store-B")
    chain_a, chain_b = r0.hasher.chain(tokens(1)), r0.hasher.chain(tokens(2))
    lease = r0.get(chain_a, req="r", step=1)
    other = r1.get(chain_b, req="r", step=1)
    assert (other.count, other.stale) == (0, True)
    r0.release(lease)
    assert counters(r0)["counters"]["decisions_conflicting"] == 1
    books_clean(counters(r0))  # (before: N blocks pinned for rank 1 until lease_ttl_s)
    mine = r1.get(chain_a, req="r", step=2)  # rank 1 decides step 2 (and holds its share) ...
    again = r1.get(chain_b, req="r", step=2)  # ... then asks it again about chain B
    assert (again.count, again.stale) == (0, True)
    lease = r0.get(chain_a, req="r", step=2)
    assert lease.count == N
    r0.release(lease)
    assert r0.stats()["pool"]["pinned"] == N  # rank 1's received share still pins chain A
    assert loaded_values(r1, mine) == {1.0}
    r1.release(mine)
    release_check_detach([], (r0, r1))
