"""native/: atomics and futexes on a real shared mapping, hashing, copies."""

import array
import threading
import time

import pytest

from kvsidecar._native import atomics as a
from kvsidecar._native import copy as ncopy
from kvsidecar._native import hashing
from kvsidecar.shm.segment import Segment

from ...waiting import wait_until


@pytest.fixture
def seg(instance):
    s = Segment.create(instance + ".t", 4096)
    yield s
    s.unlink()
    s.close()


def test_load_store_cas_fetch_add(seg):
    addr = seg.address + 64
    a.store_release_u64(addr, 5)
    assert a.load_acquire_u64(addr) == 5
    assert not a.cas_u64(addr, 4, 9)
    assert a.load_acquire_u64(addr) == 5
    assert a.cas_u64(addr, 5, 9)
    assert a.load_acquire_u64(addr) == 9
    assert a.fetch_add_u64(addr, 3) == 9
    assert a.load_acquire_u64(addr) == 12
    a.store_release_u64(addr, 2**64 - 1)
    assert a.fetch_add_u64(addr, 1) == 2**64 - 1
    assert a.load_acquire_u64(addr) == 0  # wraps mod 2**64
    a.store_release_u32(addr + 8, 7)
    assert a.fetch_add_u32(addr + 8, 1) == 7
    assert a.load_acquire_u32(addr + 8) == 8
    a.fence()


def test_cas_is_atomic_across_threads(seg):
    addr = seg.address
    a.store_release_u64(addr, 0)
    n, per = 4, 20000

    def bump():
        for _ in range(per):
            while True:
                cur = a.load_acquire_u64(addr)
                if a.cas_u64(addr, cur, cur + 1):
                    break

    ts = [threading.Thread(target=bump) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert a.load_acquire_u64(addr) == n * per


def _on_futex(tid: int, addr: int) -> bool:
    """Whether thread ``tid`` of this process is blocked in a syscall whose first argument is
    ``addr`` (the futex word: nothing else here takes that address), per /proc's syscall file."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        fields = f.read().split()  # "<nr> <arg0> ..." while blocked; "running" otherwise
    return len(fields) > 1 and int(fields[1], 16) == addr


def test_futex_wait_times_out_and_wakes(seg, timing):
    addr = seg.address + 128
    a.store_release_u32(addr, 1)
    t0 = time.monotonic()
    assert a.futex_wait(addr, 1, 0.02) is False
    assert timing.within(t0, 1.0, "a 20 ms futex timeout") >= 0.015  # it really waited
    assert a.futex_wait(addr, 2, 1.0) is True  # value differs: returns at once
    with pytest.raises(ValueError):
        a.futex_wait(addr, 1, -1.0)

    waiter = threading.get_native_id()

    def waker():  # wakes the waiter once it is on the futex (not before: that would test nothing)
        wait_until(lambda: _on_futex(waiter, addr), 10, "the main thread waiting on the futex")
        a.fetch_add_u32(addr, 1)
        a.futex_wake(addr)

    t = threading.Thread(target=waker)
    t.start()
    t0 = time.monotonic()
    assert a.futex_wait(addr, 1, 5.0) is True
    timing.within(t0, 2.0, "a futex wake")
    t.join()


def test_murmur3_known_vector():
    # MurmurHash3_x64_128("hello", seed 0) = cbd8a7b341bd9b02 5b1e906a48ae1d19
    d = hashing.murmur3_128(b"hello")
    assert int.from_bytes(d[:8], "little") == 0xCBD8A7B341BD9B02
    assert int.from_bytes(d[8:], "little") == 0x5B1E906A48AE1D19


def test_chain_hashes_are_prefix_stable_and_seeded():
    toks = array.array("I", range(1000))
    seed = bytes(range(16))
    full = hashing.chain_hashes(seed, toks, 64)
    assert len(full) == (1000 // 64) * 16  # only full blocks
    half = hashing.chain_hashes(seed, toks[:512], 64)
    assert full[: len(half)] == half
    other = hashing.chain_hashes(bytes(16), toks, 64)
    assert other[:16] != full[:16]
    changed = array.array("I", toks)
    changed[100] += 1  # block 1 changes: block 0 same, every later key differs
    ch = hashing.chain_hashes(seed, changed, 64)
    assert ch[:16] == full[:16]
    assert all(ch[i * 16:(i + 1) * 16] != full[i * 16:(i + 1) * 16] for i in range(1, len(full) // 16))
    with pytest.raises(ValueError):
        hashing.chain_hashes(b"short", toks, 64)


def test_copy_regions(seg):
    src = bytearray(range(256)) * 4
    dst = bytearray(1024)
    import ctypes
    sa = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    da = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    so = array.array("q", [0, 512, 256])
    do = array.array("q", [768, 0, 256])
    assert ncopy.copy_regions(da, do, sa, so, 128) == 3
    assert dst[768:896] == src[0:128]
    assert dst[0:128] == src[512:640]
    assert dst[256:384] == src[256:384]
    with pytest.raises(ValueError):
        ncopy.copy_regions(da, array.array("q", [0]), sa, so, 1)


def test_piece_offsets_are_blocks_by_pieces_in_order_and_check_every_id():
    got = ncopy.piece_offsets([3, 1, 0], 100, 5, 2, 10, 4)
    assert isinstance(got, array.array) and got.typecode == "q"
    assert list(got) == [305, 315, 105, 115, 5, 15]
    assert list(ncopy.piece_offsets((7,), 1 << 40, 0, 1, 0, 8)) == [7 << 40]  # 64-bit offsets
    assert list(ncopy.piece_offsets((), 100, 5, 2, 10, 4)) == []
    assert list(ncopy.piece_offsets(array.array("I", [2]), 100, 0, 3, 1, 4)) == [200, 201, 202]
    with pytest.raises(IndexError, match="block id 4 outside"):
        ncopy.piece_offsets([3, 4], 100, 5, 2, 10, 4)
    with pytest.raises(IndexError, match="block id -1 outside"):
        ncopy.piece_offsets([-1], 100, 5, 2, 10, 4)
    with pytest.raises(ValueError):
        ncopy.piece_offsets([1], 100, 5, -1, 10, 4)
    with pytest.raises(TypeError):
        ncopy.piece_offsets(["1"], 100, 5, 1, 10, 4)

    class Lying(list):  # its length is not what it yields: no offset is left unwritten or overrun
        def __init__(self, items, length):
            super().__init__(items)
            self.length = length

        def __len__(self):
            return self.length

    with pytest.raises(ValueError, match="changed length"):
        ncopy.piece_offsets(Lying([0, 1, 2], 2), 100, 0, 2, 10, 4)
    with pytest.raises(ValueError, match="changed length"):
        ncopy.piece_offsets(Lying([0], 3), 100, 0, 2, 10, 4)


def test_touch_pages_reads_one_byte_per_stride():
    import ctypes

    buf = bytearray(3 * 4096 + 10)
    buf[0], buf[4096], buf[8192], buf[12288] = 0x01, 0x02, 0x04, 0x08
    buf[1] = buf[4097] = 0xFF  # not on a stride: never read
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    assert ncopy.touch_pages(addr, len(buf), 4096) == 0x0F
    assert ncopy.touch_pages(addr, 4096, 4096) == 0x01
    assert ncopy.touch_pages(addr, 0, 4096) == 0
    assert ncopy.touch_pages(addr + 1, 4097, 4096) == 0xFF ^ 0xFF
    for bad in ((-1, 4096), (4096, 0)):
        with pytest.raises(ValueError):
            ncopy.touch_pages(addr, *bad)
