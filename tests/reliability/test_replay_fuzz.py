"""Fuzzed replays (DESIGN §6): a TP=2 group whose ranks leave, come back, die holding decisions
and restart as a new incarnation under the same name, replaying stale ``(req, step)`` keys,
releasing other incarnations' lease ids and ending requests (each rank on its own), while
another engine reuses every freed block.

Hypothesis draws the sequence.  Every GET a rank receives is loaded with ``verify_loads="all"``
and compared page by page with the KV of the chain it asked for: a block id not backed by a
pin the rank holds would hand it another chain's bytes (``CorruptBlock`` or a wrong page).
After every example the books are exact and nothing is pinned or staged."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.errors import RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

from ..conftest import SHM_PREFIX
from ..helpers import wait_until

LAY = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=2)
N = 4  # blocks per chain
POOL = 16  # four chains fill the pool: every flush and store reuses blocks
SHAPE = (N, LAY.tokens_per_block, LAY.heads_per_shard, LAY.head_dim)


def tokens(chain_no: int) -> list:
    return [chain_no * 1000 + t for t in range(N * LAY.tokens_per_block)]


def kv_of(chain_no: int, rank: int) -> list:
    """Page p of chain c, rank r: every element (c * 16 + p) * 2 + r (exact in float16)."""
    vals = torch.tensor([(chain_no * 16 + p) * 2 + rank for p in range(N)], dtype=torch.float16)
    page = vals.view(N, 1, 1, 1).expand(SHAPE).contiguous()
    return [(page.clone(), page.clone())]


@pytest.fixture(scope="module")
def sidecar_instance():
    instance = SHM_PREFIX + uuid.uuid4().hex[:10]
    ov = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    ov.update({"pool.num_blocks": POOL, "l3.backend": "none", "limits.lease_ttl_s": 600.0,
               "limits.staging_ttl_s": 600.0, "limits.decision_ttl_s": 600.0})
    sp = SidecarProcess(instance, overrides=ov, log_level="WARNING")
    yield instance
    assert sp.stop() == 0


class World:
    """Group ``g`` (the fuzzed engine, ranks may churn) and group ``h`` (another engine that only
    stores, i.e. reuses whatever blocks are free)."""

    def __init__(self, instance: str):
        self.instance = instance
        self.g = [self._conn(r, "g") for r in (0, 1)]
        self.h = [self._conn(r, "h") for r in (0, 1)]
        for c in self.g + self.h:
            c.attach()
        self.held: list[tuple] = []  # (rank, lease) a g rank holds
        self.old_ids: list[int] = []  # lease ids of past incarnations / released leases
        self.steps = 0

    def _conn(self, rank, group):
        return KVConnector(self.instance, LAY, rank=rank, group=group, populate="off", verify_loads="all")

    def get(self, rank, req, step, chain_no):
        c = self.g[rank]
        if c.pool is None:
            return
        lease = c.get(c.hasher.chain(tokens(chain_no)), req=f"r{req}", step=step)
        if lease.count:
            out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv_of(0, rank)]
            c.load(lease, out, list(range(lease.count)))  # CorruptBlock fails the example
            want = kv_of(chain_no, rank)
            for a, b in zip(want[0], out[0]):
                assert torch.equal(a[:lease.count], b[:lease.count]), (rank, req, step, chain_no, lease)
        if lease.id:
            self.held.append((rank, lease))

    def release(self, k):
        if self.held:
            rank, lease = self.held.pop(k % len(self.held))
            if self.g[rank].pool is not None:
                self.g[rank].release(lease)

    def release_old(self, rank, k):
        """Release a lease id of a past incarnation of the group: "not held" or a typed ownership
        answer, never an error, never someone else's blocks."""
        c = self.g[rank]
        if self.old_ids and c.pool is not None:
            if any(r == rank and lease.id == self.old_ids[k % len(self.old_ids)] for r, lease in self.held):
                return  # it holds that lease again (asked the same step twice): not an old id
            try:
                assert c.release(self.old_ids[k % len(self.old_ids)]) is False
            except RemoteError as exc:
                assert exc.code_name in ("NOT_OWNER", "UNKNOWN_ID"), exc

    def end(self, rank, req):
        """Rank ``rank``'s engine ends request ``req`` (SGLang's terminate): its shares of the
        request's GETs it has not received go, and its own later GETs of it are misses."""
        c = self.g[rank]
        if c.pool is not None:
            c.abort(f"r{req}")

    def leave(self, rank):
        c = self.g[rank]
        if c.pool is not None:
            c.detach()  # the sidecar drops its shares
            self.held = [(r, lease) for r, lease in self.held if r != rank]

    def come_back(self, rank):
        if self.g[rank].pool is None:
            self.g[rank] = self._conn(rank, "g")
            self.g[rank].attach()

    def restart_group(self):
        """The whole engine restarts under the same name: its leases die with the group."""
        self.old_ids += [lease.id for _r, lease in self.held]
        for r in (0, 1):
            self.leave(r)
        for r in (0, 1):
            self.come_back(r)

    def store(self, group, chain_no):
        ranks = self.g if group == "g" else self.h
        if any(c.pool is None for c in ranks):
            return
        self.steps += 1
        chain = ranks[0].hasher.chain(tokens(chain_no))
        try:
            sts = [c.store(chain, req=f"s{self.steps}", step=0) for c in ranks]
        except RemoteError as exc:
            assert exc.code_name == "LIMIT", exc  # the pool is pinned full
            return
        for r, (c, st) in enumerate(zip(ranks, sts)):
            if st.count:
                c.save(st, kv_of(chain_no, r), list(range(st.start, st.start + st.count)))
                c.commit(st)

    def flush(self):
        self.h[0].flush()

    def close(self):
        """Every rank of ``g`` releases what it holds and ends every request: then nothing is
        pinned, before any rank leaves (a share kept for a rank that ended a request, or was
        answered with a conflicting replay, would be); then every rank leaves and the books,
        read by ``h``, must be empty."""
        for rank, lease in self.held:
            if self.g[rank].pool is not None:
                self.g[rank].release(lease)
        for c in self.g:
            if c.pool is not None:
                for req in range(3):
                    c.abort(f"r{req}")
        if all(c.pool is not None for c in self.g):  # (an absent rank's shares went when it left)
            s = self.h[0].stats(check=True)
            assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0, s["leases"]
        for c in self.g:
            if c.pool is not None:
                c.detach()
        # a detach is carried out once its completion is consumed: wait until g's slots are gone
        wait_until(lambda: not any(c.get("group") == "g" for c in self.h[0].stats()["clients"]), 10.0,
                   "group g's slots released")
        s = self.h[0].stats(check=True)
        for c in self.h:
            c.detach()
        return s


actions = st.lists(st.one_of(
    st.tuples(st.just("get"), st.integers(0, 1), st.integers(0, 2), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("release_old"), st.integers(0, 1), st.integers(0, 7)),
    st.tuples(st.just("end"), st.integers(0, 1), st.integers(0, 2)),
    st.tuples(st.just("leave"), st.integers(0, 1)),
    st.tuples(st.just("come_back"), st.integers(0, 1)),
    st.tuples(st.just("restart_group")),
    st.tuples(st.just("store"), st.sampled_from(["g", "h", "h"]), st.integers(0, 7)),
    st.tuples(st.just("flush")),
), min_size=5, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions)
def test_replays_only_hand_out_blocks_the_rank_holds(sidecar_instance, seq):
    w = World(sidecar_instance)
    try:
        w.store("g", 0)
        w.store("g", 1)
        for action in seq:
            getattr(w, action[0])(*action[1:])
    finally:
        s = w.close()
    assert s["invariants"] == ""
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 and s["pool"]["staging"] == 0, s
