"""The connector's one reconnect policy (``kvsidecar.connector.reconnect``).

Units: the backoff per cause, what each error type means, the hold-off gate on a fake clock.
Real processes: a sidecar killed (-9) or stopped (SIGTERM) and restarted under the engine
adapter and under a thread pool of connections called from several threads, and a sidecar
frozen (SIGSTOP) under the adapter: its first call waits its deadline, the next ones are
misses at once until the hold-off ends; every time the books of the new incarnation are clean
and the data read back is the data written.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from kvsidecar.connector.adapter import AdapterConfig, EngineAdapter
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.connector.reconnect import Backoff, ReconnectPolicy, SidecarLink, cause_of
from kvsidecar.connector.thread_conns import ConnectionPool
from kvsidecar.shm.errors import (
    ErrorCode,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    SidecarBusy,
    SidecarUnavailable,
    UnavailableCause as Cause,
)
from kvsidecar.shm.layout import KVLayout

from ..helpers import wait_l3_idle, wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
TOKS = list(range(4 * 12))


class FakeClock:
    def __init__(self):
        self.t = 1024.0

    def __call__(self) -> float:
        return self.t


def overrides(tmp_path, **extra):
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": 128, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


# -- units ------------------------------------------------------------------------------------------
def test_backoff_per_cause():
    b = Backoff(every_s=0.5)
    assert [b.delay(Cause.NOT_RUNNING, n) for n in (1, 2, 5)] == [0.5, 0.5, 0.5]  # flat: a failed shm_open
    assert [b.delay(Cause.SLOTS_EXHAUSTED, n) for n in (1, 2, 3, 4, 40)] == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert [b.delay(Cause.REFUSED, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert b.delay(Cause.RESTARTED) == 0.0 and b.delay(Cause.BROKEN) == 0.0  # re-attach at once
    assert b.delay(Cause.TIMED_OUT) == 0.5
    assert Backoff(every_s=1.0, max_s=3.0).delay(Cause.REFUSED, 10) == 3.0
    with pytest.raises(ValueError):
        ReconnectPolicy(-1.0)


def test_errors_carry_their_cause():
    assert SidecarUnavailable("x").cause is Cause.NOT_RUNNING
    assert SidecarUnavailable("x", Cause.RESTARTED).cause is Cause.RESTARTED
    assert SidecarBusy("x").cause is Cause.SLOTS_EXHAUSTED
    assert SidecarBusy("ring full", Cause.TIMED_OUT).cause is Cause.TIMED_OUT
    assert RequestTimeout("x").cause is Cause.TIMED_OUT
    assert isinstance(RequestTimeout("x"), SidecarUnavailable) and isinstance(SidecarBusy("x"), SidecarUnavailable)
    for exc, cause in [(RequestTimeout("x"), Cause.TIMED_OUT), (SidecarBusy("x"), Cause.SLOTS_EXHAUSTED),
                       (RemoteError(ErrorCode.NOT_ATTACHED, "slot reset", "get"), Cause.BROKEN),
                       (RemoteError(ErrorCode.LIMIT, "pool full", "store"), None),  # live refusal: connection fine
                       (ProtocolError(ErrorCode.TOO_LARGE, "chain"), None)]:
        assert cause_of(exc) is cause, exc
    assert cause_of(RemoteError(ErrorCode.LAYOUT_MISMATCH, "layout", "attach"), attaching=True) is Cause.REFUSED


def test_absent_sidecar_is_tried_once_per_hold_off(instance):
    """No sidecar: the link's first call fails NOT_RUNNING, the calls inside the hold-off do not
    even try to attach, the first call after it tries again -- all misses, none raises."""
    clock = FakeClock()
    link = SidecarLink(KVConnector(instance, LAY, populate="off"), 0.25, clock=clock)
    assert link.start() is False and link.policy.last_cause is Cause.NOT_RUNNING
    calls = []
    for _ in range(5):
        assert link.call(lambda: calls.append(1), "miss") == "miss"
    assert calls == [] and link.misses == 5
    assert link.policy.causes[Cause.NOT_RUNNING] == 1  # no attach inside the hold-off
    clock.t += 0.25
    assert link.call(lambda: calls.append(1), "miss") == "miss"
    assert link.policy.causes[Cause.NOT_RUNNING] == 2
    assert link.policy.stats()["causes"]["not_running"] == 2 and link.policy.stats()["held_off"]


def test_slot_refusals_back_off_exponentially(sidecar_factory, instance, tmp_path):
    """Every slot taken: each attach is refused (SLOTS_EXHAUSTED, counted by the sidecar too) and
    the hold-off doubles up to its cap; a freed slot is taken by the first attach after it."""
    sidecar_factory(**overrides(tmp_path, **{"l3.backend": "none", "transport.num_slots": 1}))
    hog = KVConnector(instance, LAY, populate="off")
    hog.attach()
    clock = FakeClock()  # (steps of 1/16 s: exact in binary)
    link = SidecarLink(KVConnector(instance, LAY, populate="off"), 0.125, clock=clock)
    assert link.start() is False and link.policy.last_cause is Cause.SLOTS_EXHAUSTED
    waits = []
    for _ in range(4):  # the time from one refused attach to the next
        tried, t0 = link.policy.causes[Cause.SLOTS_EXHAUSTED], clock.t
        while link.policy.causes[Cause.SLOTS_EXHAUSTED] == tried:
            clock.t += 0.0625
            assert link.call(lambda: 1 / 0, "miss") == "miss"  # (fn never runs)
        waits.append(clock.t - t0)
    assert waits == [0.125, 0.25, 0.5, 0.5], waits  # doubling, capped at 4 x every_s
    # the sidecar counts refusals when it next scans its slot table, which may come after it
    # answered a stats request in the same pass (client rings are served first)
    wait_until(lambda: hog.stats()["counters"].get("slot_exhaustions", 0), 5,
               "the sidecar to count the four refused attaches", until=lambda n: n >= 4)
    hog.detach()  # (the sidecar resets the slot once it has read the detach)

    def served() -> bool:
        clock.t += 1.0  # past any hold-off
        return link.call(lambda: link.conn.lookup(b"\x01" * 16), -1) == 0

    wait_until(served, 5, "the freed slot was never taken")
    assert link.policy.attaches == 1
    link.close()


def serve(ad, req, toks, step, free=None):
    """One request through every hook; returns (restored tokens, its pages)."""
    ad.on_queue_entry(req, toks)
    ad.on_candidate(req)
    wait_until(lambda: ad.check_progress(req, step)[0], 10, f"{req}: prefetch never ended")
    free = list(range(40)) if free is None else free
    slot = ad.admit(req, toks, step + 1, lambda n: [free.pop(0) for _ in range(n)] if n <= len(free) else None)
    pages = slot.pages + free[: len(toks) // 4 - len(slot.pages)]
    ad.commit_restore(req)
    ad.store_after_prefill(req, toks, pages, step + 2)
    return slot.tokens, pages


def page_data(ad, pages):
    return [torch.stack([t[p] for t in kv]).clone() for kv in ad.kv_caches for p in pages]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_adapter_reattaches_at_the_call_that_notices_a_restart(sidecar_factory, instance, tmp_path, how):
    over = overrides(tmp_path)
    sc = sidecar_factory(**over)
    ad = EngineAdapter(instance, LAY, rank=0, group="eng",
                       config=AdapterConfig(policy="wait_complete", call_timeout_s=1.0, reattach_every_s=0.05))
    ad.kv_caches = [tuple(torch.randn(80, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    assert ad.start()
    got, src = serve(ad, "a", TOKS, 1, free=list(range(40, 80)))
    assert got == 0
    want = page_data(ad, src)
    wait_l3_idle(ad.conn)
    sc.kill() if how == "kill" else sc.stop()
    t0 = time.monotonic()
    assert serve(ad, "down", TOKS, 10)[0] == 0  # a miss, promptly
    assert time.monotonic() - t0 < 2.0 and ad.misses_degraded > 0 and not ad.available
    assert ad.link.policy.causes[Cause.RESTARTED] == 1  # the old connection's end, typed
    assert ad.link.policy.causes[Cause.NOT_RUNNING] >= 1  # the immediate re-attach found nobody
    sc = sidecar_factory(**over)  # a new incarnation: same instance, generation bumped
    wait_until(ad.link.ready, 5, "the adapter never re-attached")  # (the hold-off is 50 ms)
    assert ad.conn.client.generation == sc.generation
    got, dst = serve(ad, "b", TOKS, 20)  # restored from L3 through the new sidecar
    assert got == len(TOKS) and dst != src
    assert all(torch.equal(x, y) for x, y in zip(page_data(ad, dst), want, strict=True))
    s = ad.conn.stats(check=True)
    assert s["invariants"] == "" and s["leases"]["live"] == 0 and s["pool"]["staging"] == 0
    ad.close()


def test_restart_noticed_by_a_live_call_is_retried_on_the_new_incarnation(sidecar_factory, instance, tmp_path):
    """The sidecar is replaced between two calls: the next call notices (RESTARTED), re-attaches at
    once and is answered by the new sidecar -- not a miss.  A call bound to an old id is not resent."""
    over = overrides(tmp_path, **{"l3.backend": "none"})
    sc = sidecar_factory(**over)
    link = SidecarLink(KVConnector(instance, LAY, populate="off"), 5.0)  # a long hold-off: never waited out
    assert link.start()
    st = link.conn.store(b"\x02" * 16)
    link.conn.commit(st)
    lease = link.call(lambda: link.conn.get(b"\x02" * 16))
    assert lease.count == 1 and lease.id
    sc.stop()
    sc = sidecar_factory(**over)
    assert link.call(lambda: link.conn.release(lease), "miss", retry=False) == "miss"  # not sent to the new one
    assert link.policy.causes[Cause.RESTARTED] == 1 and not link.attached  # (it re-attaches at the next call)
    assert link.call(lambda: link.conn.lookup(b"\x02" * 16), "miss") == 0  # attached at once; a new, empty pool
    assert link.conn.client.generation == sc.generation and link.policy.attaches == 2
    sc.stop()
    sc = sidecar_factory(**over)
    assert link.call(lambda: link.conn.lookup(b"\x02" * 16), "miss") == 0  # noticed, re-attached, retried
    assert link.policy.causes[Cause.RESTARTED] == 2 and link.misses == 1
    link.close()


def test_frozen_sidecar_is_skipped_for_the_hold_off(sidecar_factory, instance, tmp_path):
    """SIGSTOP: the first call waits its deadline (TIMED_OUT); for ``reattach_every_s`` after it
    every call is a miss at once; the connection stays attached and serves again after SIGCONT."""
    sc = sidecar_factory(**overrides(tmp_path, **{"l3.backend": "none"}))
    clock = FakeClock()
    conn = KVConnector(instance, LAY, populate="off", timeout_s=0.2)
    link = SidecarLink(conn, 1.0, clock=clock)
    assert link.start()
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert link.call(lambda: conn.lookup(b"\x03" * 16), "miss") == "miss"
        assert 0.15 < time.monotonic() - t0 < 1.5
        assert link.policy.last_cause is Cause.TIMED_OUT and link.attached
        t0 = time.monotonic()
        for _ in range(20):
            assert link.call(lambda: conn.lookup(b"\x03" * 16), "miss") == "miss"
        assert time.monotonic() - t0 < 0.1  # no call waited: 20 deadlines would be 4 s
        assert link.policy.causes[Cause.TIMED_OUT] == 1 and link.misses == 21
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    clock.t += 1.0
    assert link.call(lambda: conn.lookup(b"\x03" * 16), "miss") == 0  # the same connection, no re-attach
    assert link.policy.attaches == 1
    link.close()


def test_pool_threads_ride_out_a_restart(sidecar_factory, instance, tmp_path):
    """Four threads call through one pool (thread_conns) while the sidecar is killed and restarted:
    every call returns (a miss while it is down, never an exception), the pool stays at its cap,
    its connections re-attach to the new incarnation and every block read back is the one written."""
    # a pool the calls do not cycle through: with 128 blocks the other threads' stores evicted a
    # chain between its commit and its GET whenever its thread waited a few ms for the GIL
    over = overrides(tmp_path, **{"l3.backend": "none", "pool.num_blocks": 2048})
    sc = sidecar_factory(**over)
    pool = ConnectionPool(lambda: KVConnector(instance, LAY, populate="off", timeout_s=1.0), max_connections=3,
                          reattach_every_s=0.02, name="test pool")
    stop = threading.Event()
    results, errors = [], []
    seen_generations = set()

    def store_and_read(c, t, n):
        # one chain per (thread, call): while the sidecar is down the threads spin through tens of
        # thousands of misses, so a key like t * 1000 + n would name another thread's chain
        chain = c.hasher.chain([t, n] * 4)
        st = c.store(chain)
        view = c.pool.view
        for i, b in enumerate(st.blocks):
            off = b * LAY.block_bytes
            view[off:off + LAY.block_bytes] = bytes([(t + n + i) % 251]) * LAY.block_bytes
        c.commit(st)
        lease = c.get(chain)
        try:
            ok = all(view[b * LAY.block_bytes] == (t + n + i) % 251 for i, b in enumerate(lease.blocks))
        finally:
            c.release(lease)
        seen_generations.add(c.client.generation)
        if lease.count < 2 and ok:
            return "evicted"  # LRU eviction by the other threads' stores is not a wrong block
        return lease.count == 2 and ok

    def worker(t):
        n = 0
        try:
            while not stop.is_set():
                n += 1
                results.append(pool.run(lambda c: store_and_read(c, t, n), None))
        except BaseException as exc:  # a sidecar error escaping the pool fails the test
            errors.append(exc)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in ths:
        th.start()
    try:
        for _ in range(2):
            wait_until(lambda: results.count(True) >= 20, 20, "no calls served")
            sc.kill()
            mark = len(results)
            wait_until(lambda: results[mark:].count(None) >= 8, 20, "calls hang while the sidecar is down")
            sc = sidecar_factory(**over)
            results.clear()
            wait_until(lambda: results.count(True) >= 20, 20, "no calls served after the restart")
    finally:
        stop.set()
        for th in ths:
            th.join(20)
    assert not errors and not any(th.is_alive() for th in ths)
    assert False not in results  # every block read back held what was written
    st = pool.stats()
    assert st["connections"] <= 3 and st["slot_exhaustions"] == 0, st
    assert st["unavailable_restarted"] >= 1 and st["attaches"] > st["connections"], st
    assert sc.generation in seen_generations and len(seen_generations) == 3
    with pool.checkout() as c:
        s = c.stats(check=True)
    assert s["invariants"] == "" and s["leases"]["live"] == 0 and s["pool"]["staging"] == 0
    pool.close_all()
