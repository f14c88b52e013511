"""The embedded file store: one directory, one file per block.

* **Atomic writes**: data goes to a temporary file in the same directory, then
  ``rename`` — a reader sees the old state or the whole new file, never a torn one.
* **Integrity on read**: each file is ``[magic u64][length u64][tail length u64][murmur3-128 of
  the data][data][tail]`` (the tail: the block's checksum row, which the tier verifies the
  block against); a wrong magic, length or digest (a corrupt or truncated file) is a **miss**
  — the file is removed and the block is never published.
* **Size cap with eviction**: when the total would exceed ``cap_bytes``, least recently
  used files (by mtime, refreshed on read) are removed first.
* A full disk or any I/O error fails that block only.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import struct
import threading

from kvsidecar._native.hashing import murmur3_128

from kvsidecar.sidecar.l3.base import L3Backend

log = logging.getLogger(__name__)

MAGIC = 0x324B4C4253564B  # "KVSBLK2"
_HDR = struct.Struct("<QQQ16s")


class FileStore(L3Backend):
    name = "file"

    def __init__(self, directory: str, cap_bytes: int = 0, fsync: bool = False):
        self.dir = directory
        self.cap = cap_bytes
        self.fsync = fsync
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()  # the read and write lanes share the size accounting
        self._sizes: collections.OrderedDict[str, int] = collections.OrderedDict()  # path -> bytes, LRU first
        self.total = 0
        self.counters = collections.Counter()
        self._scan()

    def _scan(self) -> None:
        entries = []
        for root, _dirs, files in os.walk(self.dir):
            for f in files:
                p = os.path.join(root, f)
                if f.endswith(".tmp"):
                    os.unlink(p)  # a write that never completed
                    continue
                st = os.stat(p)
                entries.append((st.st_mtime, p, st.st_size))
        for _, p, size in sorted(entries):
            self._sizes[p] = size
            self.total += size

    def _path(self, key: str) -> str:
        # (a NUL is the one other byte a file name cannot hold: a client's namespace may carry one)
        safe = key.replace("/", "_").replace("\x00", "%00")
        return os.path.join(self.dir, safe[-2:], safe)

    def exists(self, keys):
        return [os.path.exists(self._path(k)) for k in keys]

    def read(self, keys, addrs, size, tails=None, tail_size=0):
        tails = tails or [0] * len(keys)
        return [self._read_one(self._path(key), addr, size, tail, tail_size if tail else 0)
                for key, addr, tail in zip(keys, addrs, tails)]

    def _read_one(self, path: str, addr: int, size: int, tail: int, tail_size: int) -> bool:
        try:
            with open(path, "rb") as f:
                hdr = f.read(_HDR.size)
                if len(hdr) != _HDR.size:
                    raise ValueError("truncated header")
                magic, length, tail_length, digest = _HDR.unpack(hdr)
                if magic != MAGIC or length != size or tail_length != tail_size:
                    raise ValueError(f"bad header (magic {magic:#x}, length {length}+{tail_length}, "
                                     f"want {size}+{tail_size})")
                dst = (ctypes.c_char * size).from_address(addr)
                got = f.readinto(dst)
                if got != size:
                    raise ValueError(f"truncated data ({got} of {size} bytes)")
                if murmur3_128(memoryview(dst).cast("B")) != digest:
                    raise ValueError("checksum mismatch")
                if tail_size and f.readinto((ctypes.c_char * tail_size).from_address(tail)) != tail_size:
                    raise ValueError("truncated tail")
            os.utime(path)
            with self._lock:
                if path in self._sizes:
                    self._sizes.move_to_end(path)
            self.counters["read_ok"] += 1
            return True
        except FileNotFoundError:
            self.counters["read_miss"] += 1
            return False
        except (OSError, ValueError) as exc:
            log.warning("file store: %s is unusable (%s); removing it", path, exc)
            self.counters["read_corrupt"] += 1
            self._remove(path)
            return False

    def write(self, keys, addrs, size, tails=None, tail_size=0):
        tails = tails or [0] * len(keys)
        return [self._write_one(self._path(k), a, size, t, tail_size if t else 0)
                for k, a, t in zip(keys, addrs, tails)]

    def _write_one(self, path: str, addr: int, size: int, tail: int, tail_size: int) -> bool:
        need = _HDR.size + size + tail_size
        if self.cap and need > self.cap:
            self.counters["write_too_big"] += 1
            return False
        self._make_room(need)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            data = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
            with open(tmp, "wb") as f:
                f.write(_HDR.pack(MAGIC, size, tail_size, murmur3_128(data)))
                f.write(data)
                if tail_size:
                    f.write(memoryview((ctypes.c_char * tail_size).from_address(tail)).cast("B"))
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            self.counters["write_error"] += 1
            log.warning("file store: write of %s failed: %s", path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            old = self._sizes.pop(path, 0)
            self._sizes[path] = need
            self.total += need - old
        self.counters["write_ok"] += 1
        return True

    def _make_room(self, need: int) -> None:
        if not self.cap:
            return
        while True:
            with self._lock:
                if self.total + need <= self.cap or not self._sizes:
                    return
                victim = next(iter(self._sizes))
            self.counters["evicted"] += 1
            self._remove(victim)

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self.total -= self._sizes.pop(path, 0)

    def stats(self) -> dict:
        return {"backend": self.name, "bytes": self.total, "files": len(self._sizes), **dict(self.counters)}
