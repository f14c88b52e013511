"""The doorbell's adaptive spin (kvsidecar.shm.doorbell) and the client's wait after waking the sidecar."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

from kvsidecar.connector.client import SidecarClient
from kvsidecar.shm import doorbell as D
from kvsidecar.shm.doorbell import Doorbell

from ...waiting import wait_until


def _bell(spin_s=50e-6):
    m = mmap.mmap(-1, 4096)
    anchor = ctypes.c_char.from_buffer(m)
    return Doorbell(ctypes.addressof(anchor), 0, spin_s), (m, anchor)


def test_unpaid_spins_are_skipped_then_probed_again():
    bell, _keep = _bell()
    never = lambda: False  # noqa: E731
    for _ in range(D.SPIN_MISSES):
        assert bell.wait(never, 200e-6) is False
    assert bell.spins_unpaid == D.SPIN_MISSES and bell.spins_skipped == 0
    for i in range(D.SPIN_SKIP):
        assert bell.wait(never, 200e-6) is False
        assert bell.spins_skipped == i + 1
    assert bell.spins_unpaid == D.SPIN_MISSES
    bell.wait(never, 200e-6)  # the probe spins again
    assert bell.spins_unpaid == D.SPIN_MISSES + 1 and bell.spins_skipped == D.SPIN_SKIP


def test_a_paid_spin_keeps_spinning():
    bell, _keep = _bell()
    bell.wait(lambda: False, 200e-6)  # one miss, below SPIN_MISSES
    calls = [0]

    def ready():  # false at the first check, and rings: the spin sees it at once
        calls[0] += 1
        if calls[0] == 1:
            bell.ring()
            return False
        return True

    assert bell.wait(ready, 1.0) is True
    assert bell.spins_paid == 1
    bell.wait(lambda: False, 200e-6)  # the miss count restarted: still no skip
    assert bell.spins_skipped == 0


def test_a_skipped_spin_still_wakes_on_a_ring(timing):
    """Skipping the spin never loses a wake-up: the waiter sleeps on the futex and the ring wakes it."""
    bell, _keep = _bell()
    for _ in range(D.SPIN_MISSES):
        bell.wait(lambda: False, 100e-6)
    flag = threading.Event()
    posted = []

    def poster():
        wait_until(bell.sleeping, 5, "the waiter on the futex", interval_s=0.001)
        flag.set()
        posted.append(bell.ring())

    t = threading.Thread(target=poster)
    t.start()
    t0 = time.monotonic()
    assert bell.wait(flag.is_set, 10.0) is True
    timing.within(t0, 5.0, "a futex wake")
    t.join(5)
    assert posted == [True]  # a futex wake was posted: the waiter really slept
    assert bell.spins_skipped == 1


def test_client_does_not_spin_after_waking_a_sleeping_sidecar(sidecar, instance):
    with SidecarClient(instance, group="g") as c:
        db = c._ctl.sidecar_doorbell

        def ping_woke_it():
            wait_until(db.sleeping, 10, "the sidecar asleep on its doorbell")
            before = (c._doorbell.spins_paid, c._doorbell.spins_unpaid, c._doorbell.spins_skipped)
            posted = db.wakeups_posted  # the client's own count of the futex wakes its posts made
            assert c.call("ping", payload=b"x")["payload"] == b"x"
            woke = db.wakeups_posted - posted == 1
            if woke:  # our post was the futex wake: the wait took no spin at all
                after = (c._doorbell.spins_paid, c._doorbell.spins_unpaid, c._doorbell.spins_skipped)
                assert after == before
            return woke

        wait_until(ping_woke_it, 10, "a ping whose post woke the sleeping sidecar")


def test_a_back_to_back_stream_does_not_sleep_on_both_sides(sidecar, instance, timing):
    """A stream of back-to-back calls must not settle where each side wakes the other on every
    request (two futex wake-ups per call, ~40 us instead of ~5): the sidecar spins after waking a
    client when its last sleep was short.  The fraction is the timed copy's bound (a loaded
    machine may preempt either side); the untimed copy checks the calls themselves."""
    with SidecarClient(instance, group="g") as c:
        for _ in range(200):
            c.call("ping")
        db = c._ctl.sidecar_doorbell
        before = db.wakeups_posted
        n = 3000
        for i in range(n):
            assert c.call("ping", payload=i.to_bytes(4, "little"))["payload"] == i.to_bytes(4, "little")
        woke = (db.wakeups_posted - before) / n
        if timing.on:
            assert woke < 0.5, f"{woke:.0%} of back-to-back calls had to wake the sidecar"
