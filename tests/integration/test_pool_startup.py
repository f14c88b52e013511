"""Pool start-up (allocation modes, hugepages, SIGTERM during start-up), a rank's attach-time
populate (background, pauses for copies, stops on detach, CUDA registration hook) and the
death word that reports a killed client before its address space is torn down."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import signal
import subprocess
import threading
import time

import pytest

import kvsidecar.shm.populate as P
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.connector.pool_populate import PoolPopulator
from kvsidecar.shm.deathword import DEATH_WORD_OFFSET, DeathSentinel, DeathWordWatch
from kvsidecar.shm.errors import SegmentError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.shm.segment import Segment, unlink_segment
from kvsidecar.sidecar.config import ConfigError, load_config
from kvsidecar.sidecar.kv.pool_memory import create_pool_segment
from kvsidecar.sidecar.spawn import child_env, launcher_argv

from ..helpers import store_get_load_equal
from ..waiting import wait_until

MiB = 1 << 20
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16, tp_size=1)  # 8 KiB blocks


def _cfg(instance, **over):
    base = {"instance": instance, "pool.hugepages": "off"}
    base.update(over)
    return load_config(None, base)


def _toml(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else repr(v)


def _shm_allocated(name: str) -> int:
    return os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512


# -- the sidecar's pool ------------------------------------------------------------------------
@pytest.mark.parametrize("mode,allocated,mapped", [
    ("write", True, False),  # zeros through the fd: resident, but the sidecar maps none of it
    ("map", True, True),  # fallocate + MADV_POPULATE_READ of its own mapping
    ("fallocate", True, False),
    ("touch", True, True),  # the old loop
    ("none", False, False),
])
def test_pool_allocation_modes(instance, mode, allocated, mapped, caplog):
    size = 8 * MiB
    with caplog.at_level(logging.INFO, logger="kvsidecar.sidecar.kv.pool_memory"):
        seg = create_pool_segment(_cfg(instance, **{"pool.populate": mode, "pool.populate_threads": 2}), size)
    try:
        assert seg.size == size and seg.page_size == P.PAGE
        assert _shm_allocated(seg.name) == (size if allocated else 0)
        assert P.resident_bytes(seg.address) == (size if mapped else 0)
        assert bytes(seg.view[:4096]) == bytes(4096)
        assert any("ready:" in r.getMessage() and f"populate={mode}" in r.getMessage() for r in caplog.records)
    finally:
        seg.unlink()
        seg.close()


def test_a_read_populate_ends_every_chunk_by_marking_its_pages_accessed(instance, monkeypatch):
    """A READ populate reads one byte of every page it mapped (``mark_accessed``: the first real
    pass then runs at the speed of the second, ``bench startup``); a WRITE populate does not."""
    size = 5 * MiB + 4096
    seg = Segment.create(f"/{instance}.acc", size, init=lambda fd, n: P.fallocate(fd, n))
    try:
        for write in (False, True):
            seen = []
            real = P.mark_accessed
            monkeypatch.setattr(P, "mark_accessed", lambda a, n: (seen.append((a - seg.address, n)), real(a, n)))
            P.populate(seg.address, size, write=write, threads=2, chunk=MiB)
            covered = sorted(seen)
            if write:
                assert covered == []
            else:
                assert covered == [(o, min(MiB, size - o)) for o in range(0, size, MiB)]
            assert P.resident_bytes(seg.address) == size
    finally:
        seg.unlink()
        seg.close()


def test_segment_populate_maps_every_page_for_an_attacher(instance):
    size = 6 * MiB + 4096  # not a multiple of the chunk
    owner = Segment.create(f"/{instance}.pop", size, init=lambda fd, n: P.fill_zeros(fd, n, chunk=MiB))
    try:
        assert P.resident_bytes(owner.address) == 0 and _shm_allocated(owner.name) == size
        for readonly in (False, True):
            seg = Segment.attach(f"/{instance}.pop", readonly=readonly)
            try:
                assert P.resident_bytes(seg.address) == 0
                assert seg.populate(threads=3, chunk=MiB) == "madvise"
                assert P.resident_bytes(seg.address) == size
            finally:
                seg.close()
        stop = threading.Event()
        stop.set()
        seg = Segment.attach(f"/{instance}.pop")
        try:
            with pytest.raises(P.Interrupted):
                seg.populate(stop=stop)
        finally:
            seg.close()
    finally:
        owner.unlink()
        owner.close()


def test_failed_init_removes_the_segment(instance):
    def boom(fd, size):
        raise SegmentError("no room")

    with pytest.raises(SegmentError, match="no room"):
        Segment.create(f"/{instance}.x", MiB, init=boom)
    assert not os.path.exists(f"/dev/shm/{instance}.x")


def test_hugepages_auto_falls_back_with_a_log_line(instance, caplog):
    if P.hugepages_available() >= 2 * MiB:
        pytest.skip("this machine has free huge pages: auto uses them")
    with caplog.at_level(logging.INFO, logger="kvsidecar.sidecar.kv.pool_memory"):
        seg = create_pool_segment(_cfg(instance, **{"pool.hugepages": "auto"}), 4 * MiB)
    try:
        assert seg.name == f"/{instance}.pool" and seg.page_size == P.PAGE
        assert any("4 KiB pages: huge pages unavailable" in r.getMessage() for r in caplog.records)
    finally:
        seg.unlink()
        seg.close()
    with pytest.raises(SegmentError, match="pool.hugepages = on"):
        create_pool_segment(_cfg(instance, **{"pool.hugepages": "on"}), 4 * MiB)
    assert not os.path.exists(f"/dev/shm/{instance}.pool")


def test_hugepage_memfd_pool_round_trip(sidecar_factory, instance):
    if P.hugepages_available() < 8 * MiB:
        pytest.skip("no free 2 MiB pages on this machine (vm.nr_hugepages)")
    import torch

    over = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    over.update({"pool.num_blocks": 64, "pool.hugepages": "on"})
    sidecar_factory(**over)
    with KVConnector(instance, LAY, populate="sync") as c:
        assert c.pool.name.startswith("/proc/") and c.pool.page_size == P.HUGE_PAGE
        assert c.populate_stats()["done"] and P.resident_bytes(c.pool.address) == c.pool.size
        kv = [tuple(torch.randn(8, 16, 2, 32).half() for _ in range(2)) for _ in range(2)]
        assert store_get_load_equal(c, kv, list(range(16 * 8))) == 8


def test_bad_pool_options_are_config_errors(instance):
    for key, value, msg in (("pool.populate", "fast", "pool.populate"), ("pool.hugepages", "yes", "pool.hugepages"),
                            ("pool.populate_threads", -1, "populate_threads")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, {"instance": instance, key: value})


@pytest.mark.parametrize("mode,phase", [("write", "allocating"), ("map", "mapping")])
def test_sigterm_during_prefault_stops_cleanly_and_unlinks(instance, tmp_path, mode, phase):
    """A 1 GiB pool: SIGTERM once the progress log shows the allocation under way."""
    args = launcher_argv() + [  # python -m kvsidecar.sidecar
        "--instance", instance, "--log-level", "INFO",
        "--set", "l3.backend=\"none\"", "--set", f"run_dir=\"{tmp_path}\"", "--set", "pool.hugepages=\"off\"",
        "--set", f"pool.populate=\"{mode}\"", "--set", "pool.num_blocks=131072"]  # 131072 x 8 KiB = 1 GiB
    for k, v in LAY.as_dict().items():
        args += ["--set", f"layout.{k}={_toml(v)}"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=child_env())
    seen = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if f": {phase} " in line:
                proc.send_signal(signal.SIGTERM)
                break
        assert any(f": {phase} " in s for s in seen), "".join(seen)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = "".join(seen) + rest
    assert proc.returncode == 0, log
    assert "start-up interrupted by a signal; segments unlinked" in log
    assert " ready:" not in log
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(instance)]
    assert not (tmp_path / f"{instance}.ready").exists()


# -- a rank's mapping ---------------------------------------------------------------------------
def _owner(instance, size=8 * MiB):
    return Segment.create(f"/{instance}.pool", size, init=P.fill_zeros)


def test_background_populate_pauses_for_copies_and_finishes(instance):
    owner = _owner(instance)
    seg = Segment.attach(owner.name)
    try:
        pop = PoolPopulator(seg, chunk=MiB)
        with pop.copying():
            pop.start()
            assert not pop.wait(0.2)  # paused before its first chunk while the engine copies
            assert pop.done_bytes == 0 and P.resident_bytes(seg.address) == 0
        assert pop.wait(10)
        st = pop.stats()
        assert st["done"] and st["bytes"] == seg.size and st["error"] is None and st["method"] == "madvise"
        assert P.resident_bytes(seg.address) == seg.size
    finally:
        seg.close()
        owner.unlink()
        owner.close()


def test_stop_ends_the_populate_within_a_chunk(instance, monkeypatch):
    owner = _owner(instance)
    seg = Segment.attach(owner.name)
    real = P.populate
    gate = threading.Event()

    def gated(*a, **kw):  # the first chunk waits until the populator is told to stop
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(P, "populate", gated)
    try:
        pop = PoolPopulator(seg, chunk=MiB)
        threading.Thread(target=lambda: (pop._stop.wait(10), gate.set()), daemon=True).start()
        pop.start()
        pop.stop()
        assert pop.done and pop.error is None
        assert pop.done_bytes <= MiB < seg.size
    finally:
        seg.close()
        owner.unlink()
        owner.close()


def test_cuda_registration_hook(instance, caplog):
    owner = _owner(instance)
    seg = Segment.attach(owner.name)
    calls = []
    try:
        pop = PoolPopulator(seg, cuda_device=0, registrar=lambda addr, size, dev: calls.append((addr, size, dev)))
        with caplog.at_level(logging.INFO, logger="kvsidecar.connector.pool_populate"):
            pop.run()
        assert calls == [(seg.address, seg.size, 0)]
        assert pop.cuda_registered and pop.method == "cudaHostRegister" and pop.wait_registration(0)
        assert any("registered with CUDA" in r.getMessage() for r in caplog.records)

        def fails(addr, size, dev):
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

        pop = PoolPopulator(seg, cuda_device=0, registrar=fails)
        pop.run()  # falls back to populating; the copier would register lazily
        assert not pop.cuda_registered and pop.method == "madvise"
        assert P.resident_bytes(seg.address) == seg.size
    finally:
        seg.close()
        owner.unlink()
        owner.close()


def test_connector_attach_does_not_wait_for_the_populate(sidecar_factory, instance, monkeypatch):
    over = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    over.update({"pool.num_blocks": 1024})
    sidecar_factory(**over)
    real = P.populate
    gate = threading.Event()

    def gated(*a, **kw):
        gate.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(P, "populate", gated)
    c = KVConnector(instance, LAY)
    c.attach()
    try:
        assert not c.populate_stats()["done"]  # attach returned; the populate waits on the gate
        assert c.client.call("ping")["ok"]
        gate.set()
        assert c.wait_populated(10)
        st = c.populate_stats()
        assert st["done"] and st["bytes"] == c.pool.size and st["seconds"] is not None
        assert P.resident_bytes(c.pool.address) == c.pool.size
    finally:
        gate.set()
        c.detach()
    assert c.populator is None and c.pool is None
    off = KVConnector(instance, LAY, populate="off")
    with off:
        assert off.populate_stats() == {"method": "off", "done": True} and P.resident_bytes(off.pool.address) == 0


# -- death words --------------------------------------------------------------------------------
def _hold_sentinel(name: str, conn) -> None:
    seg = Segment.attach(name)
    s = DeathSentinel(seg.address + DEATH_WORD_OFFSET)
    conn.send(s.held)
    if conn.recv() == "release":
        s.release()
        conn.send("released")
        conn.recv()


def test_death_word_reports_a_killed_holder_and_not_a_release(instance):
    ctx = mp.get_context("spawn")
    seg = Segment.create(f"/{instance}.dw", 4096)
    try:
        for how in ("kill", "release"):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_hold_sentinel, args=(seg.name, b))
            p.start()
            assert a.poll(30) and a.recv() is True
            died = threading.Event()
            dw = DeathWordWatch(seg.address + DEATH_WORD_OFFSET, p.pid, died.set)
            wait_until(lambda: dw.tid, 5, "the watch armed on the holder's tid", interval_s=0.001)
            if how == "kill":
                os.kill(p.pid, signal.SIGKILL)
                assert died.wait(10)
            else:
                a.send("release")
                assert a.poll(10) and a.recv() == "released"
                dw.join(5)
                assert not dw.alive and not died.is_set()
                a.send("exit")
            p.join(10)
            dw.stop()
            assert not dw.alive
    finally:
        seg.unlink()
        seg.close()


def test_death_word_watch_stops_promptly(instance):
    seg = Segment.create(f"/{instance}.dw", 4096)
    try:
        s = DeathSentinel(seg.address + DEATH_WORD_OFFSET)  # held by a thread of this process
        assert s.held
        dw = DeathWordWatch(seg.address + DEATH_WORD_OFFSET, os.getpid(), lambda: None)
        wait_until(lambda: dw.tid, 5, "the watch armed on the holder's tid", interval_s=0.001)
        dw.stop(join_s=5)
        assert not dw.alive
        s.release()
    finally:
        seg.unlink()
        seg.close()
