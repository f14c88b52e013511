"""Shared fixtures: real sidecar processes, and leak checks after every test.

Every test gets an instance name of its own (``kvst-...``); after each test no
segment with that prefix may remain in /dev/shm and no child process may be left
running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest

from kvsidecar.sidecar.spawn import SidecarProcess

# Per test process, so two test runs on one machine never mistake each other's segments for leaks.
SHM_PREFIX = f"kvst{os.getpid()}-"


def _our_segments() -> set[str]:
    """This run's shared memory: segments, and the named semaphores of read gates (sem.<name>)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX) or n.startswith("sem." + SHM_PREFIX)}


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[1]) == me and rest[0] != "Z":
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"resource_tracker" in cmd or b"forkserver" in cmd:
                continue  # multiprocessing's own long-lived helpers
            out.add(int(pid))
    return out


RUN_DIR = "/tmp/kvsidecar"  # kvsidecar.sidecar.config's default run_dir, which most tests' sidecars use


@pytest.fixture(autouse=True, scope="session")
def run_dir_files_removed():
    """A sidecar leaves its file-store L3 directory (data, by design), its Mooncake log and, when
    killed, its ready marker in the run dir; this run's (named with SHM_PREFIX) go at the end."""
    yield
    import shutil

    try:
        names = os.listdir(RUN_DIR)
    except FileNotFoundError:
        return
    for n in names:
        if n.startswith(SHM_PREFIX):
            path = os.path.join(RUN_DIR, n)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


@pytest.fixture(autouse=True)
def no_leaks():
    before_segs = _our_segments()
    before_kids = _children()
    yield
    for p in mp.active_children():
        p.join(5)
    leaked = _our_segments() - before_segs
    assert not leaked, f"segments left behind: {leaked}"
    kids = _children() - before_kids
    assert not kids, f"child processes left running: {kids}"


@pytest.fixture
def instance() -> str:
    return SHM_PREFIX + uuid.uuid4().hex[:10]


@pytest.fixture
def spawn_ctx():
    return mp.get_context("spawn")


@pytest.fixture
def sidecar_factory(instance):
    started: list[SidecarProcess] = []

    def start(**overrides) -> SidecarProcess:
        sp = SidecarProcess(instance, overrides=overrides, log_level="WARNING")
        started.append(sp)
        return sp

    yield start
    for sp in started:
        rc = sp.stop()
        # 0: clean; -9: killed by the test; 3 would mean broken accounting at shutdown
        assert rc in (0, -9), f"sidecar exited with {rc}"
    # A killed sidecar leaves its segments; the tests that kill one restart or clean up.
    for name in list(_our_segments()):
        if name.startswith(instance):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture
def sidecar(sidecar_factory) -> SidecarProcess:
    return sidecar_factory()


@pytest.fixture
def mooncake_master():
    """A real mooncake_master on 127.0.0.1 (free ports), stopped by pid after the test."""
    from kvsidecar.sidecar.l3.master import MooncakeMaster

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    m = MooncakeMaster(client_ttl_s=2, kv_lease_ttl_ms=200)
    yield m
    m.stop()


class Timing:
    """A wall-clock bound on one step of a test.  Such bounds are the ``timing`` marker's (they
    depend on how loaded the machine is): the default suite runs each such test once as
    ``[untimed]`` (behaviour only; ``within`` checks nothing), and ``scripts/run_tests.sh`` runs
    the ``[timed]`` copies as a step of their own (``-m timing``), where ``within`` asserts."""

    def __init__(self, on: bool):
        self.on = on

    def within(self, t0: float, limit_s: float, what: str) -> float:
        """Seconds since ``t0`` (time.monotonic); when timed, assert they are under ``limit_s``."""
        import time

        return self.below(time.monotonic() - t0, limit_s, what)

    def below(self, seconds: float, limit_s: float, what: str) -> float:
        """A duration measured elsewhere (e.g. a session's ``stop_ms`` / 1e3); when timed, assert
        it is under ``limit_s``."""
        if self.on:
            assert seconds < limit_s, f"{what}: took {seconds:.3f} s, bound {limit_s} s"
        return seconds


@pytest.fixture(params=[pytest.param(False, id="untimed"),
                        pytest.param(True, id="timed", marks=pytest.mark.timing)])
def timing(request) -> Timing:
    return Timing(request.param)


@pytest.fixture
def read_gate():
    """A closed read gate for the shaped L3 (pass ``read_gate.overrides()`` to the sidecar, then
    ``read_gate.open()``); its semaphore is unlinked after the test."""
    from .waiting import ReadGate

    with ReadGate() as gate:
        yield gate
