"""The shaped L3's read gate (``l3.read_gate``): reads wait at a named semaphore the test holds,
until it opens it once; closing the backend lets held reads go; no gate, no semaphore touched."""

from __future__ import annotations

import ctypes
import threading

import posix_ipc
import pytest

from kvsidecar.sidecar.l3.filestore import FileStore
from kvsidecar.sidecar.l3.shaped import ShapedBackend

from ....waiting import ReadGate, wait_until


def _written(tmp_path, n=3, size=256):
    fs = FileStore(str(tmp_path / "l3"))
    src = ctypes.create_string_buffer(bytes(range(256)) * (size // 256), size)
    assert fs.write([f"k{i}" for i in range(n)], [ctypes.addressof(src)] * n, size) == [True] * n
    return fs


def _read_in_thread(backend, keys, size=256):
    dst = [ctypes.create_string_buffer(size) for _ in keys]
    got = []
    t = threading.Thread(target=lambda: got.append(backend.read(keys, [ctypes.addressof(d) for d in dst], size)))
    t.start()
    return t, got


def test_reads_wait_at_the_gate_until_it_opens_then_it_stays_open(tmp_path):
    with ReadGate() as gate:
        sb = ShapedBackend(_written(tmp_path), read_gate=gate.name)
        t1, got1 = _read_in_thread(sb, ["k0"])
        t2, got2 = _read_in_thread(sb, ["k1", "k2"])
        wait_until(lambda: sb.stats()["gate_waiting"], 10, "two reads held", until=lambda n: n == 2)
        assert got1 == [] and got2 == [] and sb.in_flight == 2  # held, not done
        gate.open()
        t1.join(10)
        t2.join(10)
        assert got1 == [[True]] and got2 == [[True, True]]
        assert sb.stats()["gate_waiting"] == 0
        t3, got3 = _read_in_thread(sb, ["k0"])  # once open, a read passes straight through
        t3.join(10)
        assert got3 == [[True]]
        sb.close()


def test_close_lets_a_held_read_go(tmp_path):
    with ReadGate() as gate:
        sb = ShapedBackend(_written(tmp_path), read_gate=gate.name)
        t, got = _read_in_thread(sb, ["k0"])
        wait_until(lambda: sb.stats()["gate_waiting"], 10, "a read held")
        sb.close()
        t.join(10)
        assert not t.is_alive() and len(got) == 1


def test_no_gate_by_default_and_a_missing_one_is_an_error(tmp_path):
    sb = ShapedBackend(_written(tmp_path), latency_s=0.001)
    assert sb._gate is None and "gate_waiting" not in sb.stats()
    t, got = _read_in_thread(sb, ["k0"])
    t.join(10)
    assert got == [[True]]
    with pytest.raises(posix_ipc.ExistentialError):
        ShapedBackend(_written(tmp_path), read_gate="/kvst-no-such-gate")
