"""Tier A: vLLM's real Scheduler driving kvsidecar's connector, a real sidecar, file-store L3.

Each test plays vLLM's model runner (``tests/vllm/harness.py``): every KV block vLLM believes
computed or loaded is checked byte for byte, and the sidecar's books (leases, staging, pins,
invariants) must be empty when the requests are done.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

pytest.importorskip("vllm")

from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.connector.vllm_config import VllmConfigError, VllmConnectorConfig  # noqa: E402
from kvsidecar.shm.chain import span as chain_span  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402

from .harness import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, MODEL, Engine, sidecar_overrides  # noqa: E402
from .tiny_llama import write_config  # noqa: E402

pytestmark = pytest.mark.vllm

LAYOUT = KVLayout(model=MODEL, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                  tokens_per_block=BLOCK, tp_size=1)


@pytest.fixture
def model_dir(tmp_path):
    return write_config(tmp_path / "tiny-llama")


@pytest.fixture
def engines(model_dir, instance):
    made = []

    def make(**kw):
        e = Engine(model_dir, instance, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def probe(instance):
    """A client of its own (another group) for the sidecar's books and for injecting faults."""
    made = []

    def make(group="probe"):
        c = KVConnector(instance, LAYOUT, group=group, namespace="vllm/", populate="off")
        c.attach()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def books_clean(c: KVConnector) -> dict:
    from tests.helpers import wait_l3_idle

    wait_l3_idle(c)  # write-behind PUTs hold their blocks until they land
    s = c.stats(check=True)
    assert s["invariants"] == "", s["invariants"]
    assert s["leases"]["live"] == 0, s["leases"]
    assert s["store"]["open"] == 0, s["store"]
    return s


def prompt(n_tokens: int, seed: int = 0) -> list:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n_tokens)]


def store_through(e: Engine, rid: str, tokens: list) -> None:
    """Run ``tokens`` through engine ``e`` (a cold prefill that stores its full blocks)."""
    e.add(rid, tokens)
    e.finish(rid)


def test_miss_then_stores(sidecar_factory, tmp_path, engines, probe):
    sidecar_factory(**sidecar_overrides(tmp_path))
    e = engines()
    tokens = prompt(100)
    store_through(e, "r0", tokens)
    sc, wk = e.sched_conn.scheduler, e.worker_conn.worker
    assert e.outputs["r0"] == [7, 8]
    assert e.prefill["r0"].num_external_cached_tokens == 0
    assert sc.counters["sessions"] == 1 and sc.counters["misses"] == 1 and sc.counters["hits"] == 0
    assert wk.counters["stored_blocks"] == 3  # 100 tokens: 3 full blocks
    c = probe()
    assert c.lookup(e.chains["r0"]) == 3  # published: every (the one) rank committed
    books_clean(c)


def test_full_hit_loads_every_block(sidecar_factory, tmp_path, engines, probe):
    sidecar_factory(**sidecar_overrides(tmp_path))
    a = engines()
    tokens = prompt(4 * BLOCK)  # block-aligned: a full hit
    store_through(a, "w", tokens)
    b = engines()  # a fresh engine: vLLM's own prefix cache is empty
    b.add("r", tokens)
    b.finish("r")
    assert b.prefill["r"].num_external_cached_tokens == 4 * BLOCK
    assert b.sched_conn.scheduler.counters["hit_tokens"] == 4 * BLOCK
    assert b.worker_conn.worker.counters["loaded_blocks"] == 4
    assert not b.load_errors_seen and "r" in b.finished_recving_seen
    b.check_blocks("r", 4)
    assert b.outputs["r"] == a.outputs["w"]
    books_clean(probe())


def test_partial_prefix_from_a_stop(sidecar_factory, tmp_path, engines, probe):
    """The pool is cold, L3 has 8 blocks, a slow L3 and a short budget stop the session after a
    few chunks: vLLM loads exactly the drained prefix and recomputes the rest."""
    over = sidecar_overrides(tmp_path)
    sp = sidecar_factory(**over)
    a = engines()
    tokens = prompt(8 * BLOCK + 5)
    store_through(a, "w", tokens)
    c = probe()
    from tests.helpers import wait_l3_idle

    wait_l3_idle(c)
    c.close()
    a.close()
    sp.stop()
    sidecar_factory(**over, **{"l3.latency_ms": 60.0})  # restarted cold, L3 reads 60 ms each
    b = engines(extra={"budget_s": 0.15, "chunk_max_blocks": 2})
    b.add("r", tokens)
    b.finish("r")
    ext = b.prefill["r"].num_external_cached_tokens
    assert 0 < ext < 8 * BLOCK and ext % BLOCK == 0, ext
    n = ext // BLOCK
    assert b.worker_conn.worker.counters["loaded_blocks"] == n
    b.check_blocks("r", 8)  # loaded [0, n), recomputed [n, 8): all of it right
    c = probe()
    s = books_clean(c)
    assert s["sessions"]["terminal_timeout"] == 1
    assert c.lookup(b.chains["r"]) == 8  # the recomputed tail was stored too


def test_two_engines_share_one_pool(sidecar_factory, tmp_path, engines, probe):
    sidecar_factory(**sidecar_overrides(tmp_path))
    a, b = engines(), engines()
    assert a.sched_conn.group != b.sched_conn.group
    shared = prompt(3 * BLOCK, seed=1)
    store_through(a, "a0", shared + prompt(40, seed=2))
    b.add("b0", shared + prompt(50, seed=3))  # the same 3-block prefix, another tail
    b.finish("b0")
    assert b.prefill["b0"].num_external_cached_tokens == 3 * BLOCK
    b.check_blocks("b0", 4)
    books_clean(probe())


def test_abort_while_waiting_for_remote_kv(sidecar_factory, tmp_path, engines, probe):
    from vllm.v1.request import RequestStatus

    sidecar_factory(**sidecar_overrides(tmp_path))
    a = engines()
    tokens = prompt(6 * BLOCK)
    store_through(a, "w", tokens)
    b = engines()
    gate = threading.Event()
    held = []

    def hold_the_copy(so):  # the rank's copy thread is busy until the gate opens
        if so.kv_connector_metadata.plan.loads and not held:
            held.append(b.worker_conn.worker._pool.submit(gate.wait, 10))

    b.add("r", tokens)
    for _ in range(20):
        b.step(before_load=hold_the_copy)
        if b.request("r").status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert held and b.worker_conn.worker.loads_in_flight == 1
    free_before = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    b.abort("r")  # the load is in flight in the rank: vLLM keeps its blocks until it finished
    assert b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    gate.set()
    b.run(lambda: "r" in b.finished_recving_seen and "r" not in b.scheduler.requests)
    assert b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 6
    assert "r" not in b.sched_conn.scheduler.reqs
    books_clean(probe())


def test_abort_while_prefetching(sidecar_factory, tmp_path, engines, probe):
    over = sidecar_overrides(tmp_path)
    sp = sidecar_factory(**over)
    a = engines()
    tokens = prompt(8 * BLOCK)
    store_through(a, "w", tokens)
    a.close()
    sp.stop()
    sidecar_factory(**over, **{"l3.latency_ms": 200.0})
    b = engines(extra={"policy": "wait_complete"})
    b.add("r", tokens)
    for _ in range(3):
        b.step()  # the session runs: the request is skipped (None), nothing scheduled
    st = b.sched_conn.scheduler.reqs["r"]
    assert st.phase == "prefetching" and b.request("r").num_computed_tokens == 0
    b.abort("r")
    assert "r" not in b.sched_conn.scheduler.reqs
    c = probe()
    from tests.helpers import wait_terminal

    c.client.group = b.sched_conn.scheduler.conn.client.group  # read the session from its group
    c.attach()
    view = wait_terminal(c, st.sreq)
    assert view["status"] == "aborted" and view["lease"] == 0
    books_clean(c)


def test_preemption_starts_a_new_attempt(sidecar_factory, tmp_path, engines, probe):
    """Two requests fill vLLM's 8 usable blocks; the first one's decode preempts the second,
    which comes back as a new attempt (its old session ended) and finishes right."""
    sidecar_factory(**sidecar_overrides(tmp_path))
    e = engines(num_gpu_blocks=9)
    e.add("a", prompt(4 * BLOCK, seed=4), max_tokens=3)
    e.add("b", prompt(4 * BLOCK, seed=5), max_tokens=3)
    e.run(lambda: "a" in e.finished and "b" in e.finished)
    assert e.request("b") is None or e.finished["b"]
    sc = e.sched_conn.scheduler
    assert e.outputs["a"] == [7, 8, 9] and e.outputs["b"] == [7, 8, 9]
    assert sc.counters["sessions"] >= 3, sc.counters  # a, b, and b's second attempt
    assert not sc.reqs
    books_clean(probe())


@pytest.mark.parametrize("failure_policy", ["recompute", "fail"])
def test_load_error(sidecar_factory, tmp_path, engines, probe, failure_policy):
    """Blocks evicted between the decision and the load (the prefetch lease dropped by force,
    the pool flushed, only the first 2 blocks kept): the workers report blocks 2.. as load
    errors; under "recompute" vLLM recomputes from block 2, under "fail" the request fails."""
    sidecar_factory(**sidecar_overrides(tmp_path))
    a = engines()
    tokens = prompt(6 * BLOCK + 3)
    store_through(a, "w", tokens)
    b = engines(policy=failure_policy)
    keep = probe()
    pin = keep.get(chain_span(a.chains["w"], 0, 2))  # another client keeps blocks 0-1 resident
    sched_group = probe(group=b.sched_conn.scheduler.conn.client.group)

    def evict(so):
        for spec in so.kv_connector_metadata.plan.loads:
            sched_group.abort(spec.sreq, attempt=spec.attempt)  # its prefetch lease goes
            sched_group.flush()

    b.add("r", tokens)
    b.run(lambda: "r" in b.finished, before_load=evict)
    assert len(b.load_errors_seen) == 4  # blocks 2..5
    if failure_policy == "recompute":
        assert b.outputs["r"] == [7, 8]
        b.check_blocks("r", 6)
    else:
        assert str(b.finished["r"].finish_reason) in ("error", "FinishReason.ERROR"), b.finished["r"].finish_reason
    keep.release(pin)
    books_clean(keep)


def test_sidecar_killed_mid_load(sidecar_factory, tmp_path, engines, probe):
    """kill -9 between the load decision and the workers' GET: every block is a load error, the
    request recomputes (recompute policy); the restarted sidecar is re-attached and serves."""
    over = sidecar_overrides(tmp_path)
    sp = sidecar_factory(**over)
    a = engines()
    tokens = prompt(5 * BLOCK)
    store_through(a, "w", tokens)
    b = engines()
    killed = []

    def kill(so):
        if so.kv_connector_metadata.plan.loads and not killed:
            os.kill(sp.proc.pid, signal.SIGKILL)
            killed.append(sp.proc.wait(5))

    b.add("r", tokens)
    b.run(lambda: "r" in b.finished, before_load=kill)
    assert killed == [-9]
    assert b.outputs["r"] == [7, 8]
    assert len(b.load_errors_seen) == 5
    b.check_blocks("r", 5)
    sidecar_factory(**over)  # back, cold pool (the old segments were replaced)
    b.add("r2", prompt(3 * BLOCK, seed=9))
    b.finish("r2")
    assert b.outputs["r2"] == [7, 8]
    assert b.worker_conn.worker.link.attached and b.sched_conn.scheduler.link.attached
    c = probe()
    assert c.lookup(b.chains["r2"]) == 3
    books_clean(c)


def test_sidecar_absent_is_a_miss(tmp_path, engines):
    e = engines()  # nothing serves the instance
    e.add("r", prompt(3 * BLOCK))
    e.finish("r")
    assert e.outputs["r"] == [7, 8]
    assert e.prefill["r"].num_external_cached_tokens == 0


def test_unknown_config_key_refused(engines):
    with pytest.raises(VllmConfigError, match=r"unknown key\(s\) 'bogus'"):
        engines(extra={"bogus": 1})
    with pytest.raises(VllmConfigError, match="policy"):
        VllmConnectorConfig.from_extra({"policy": "sometimes"})
    with pytest.raises(VllmConfigError, match="budget_s"):
        VllmConnectorConfig.from_extra({"budget_s": "soon"})
    assert VllmConnectorConfig.from_extra({"budget_s": 1}).budget_s == 1.0
