"""The pool's bytes: one shared segment of ``num_blocks × block_bytes``, allocated at start.

Backing (``pool.hugepages``, default ``"auto"``):

* ``pool.hugepage_dir`` set: a file on that hugetlbfs mount (2 MiB pages).
* else, when the kernel has enough free 2 MiB pages: an ``MFD_HUGETLB`` memfd, which
  clients open as ``/proc/<sidecar pid>/fd/<n>`` (it vanishes with its last user).
* else POSIX shm ``/dev/shm/<instance>.pool`` with 4 KiB pages; the log says why.

Huge pages mean 512× fewer page-table entries: mapping, populating and tearing
down a large pool are that much cheaper in every process that maps it.
``"on"`` makes huge pages mandatory (a start-up error otherwise), ``"off"`` never
uses them.

Allocation (``pool.populate``), no per-page Python loop in any mode.  What each
guarantees (4 KiB pages on /dev/shm; a hugetlb pool is always ``fallocate``d, which
reserves and zeroes its 2 MiB pages, whatever the mode except ``none``):

* ``"fallocate"`` (default, the fastest correct mode: one ``posix_fallocate``,
  measured at the floor of a bare ``fallocate`` of the same size): every page is
  allocated and charged now, so a full /dev/shm or memory limit is ENOSPC at start,
  and no page can be missing later (no SIGBUS, no late ENOSPC).  The pages are zeroed
  by their first toucher (a rank's or the sidecar's background populate), off the
  start-up path.
* ``"write"``: the same guarantee, plus every page zeroed before ready by writing
  zeros through the file (1.3-4.5x a fallocate, measured: the zeroing is paid at start).
* ``"map"``: ``fallocate``, then ``MADV_POPULATE_READ`` of the sidecar's own mapping
  from ``pool.populate_threads`` threads before ready.
* ``"touch"``: the original single-threaded loop of Python writes (the benchmark's
  baseline); same guarantee once it finished.
* ``"none"`` (or ``pool.prefault = false``): nothing reserved.  The only mode that
  trades the guarantee away: if /dev/shm fills up, the first touch of a page is a
  SIGBUS in whichever process touches it; start-up logs a warning saying so.

The sidecar's own mapping (``pool.sidecar_populate``, default "auto" = when an L3
backend is configured): L3 reads land in the pool through this process's mapping,
so after ready one background thread (``kvsidecar.shm.mapping_populator``, the connector's
mechanism) gives every page of it a page-table entry — or, on a CUDA host
(``pool.cuda_register``), ``cudaHostRegister``s it — so restores never fault.  It
never delays ready (it starts after the ready marker), never runs on the control
thread, pauses while a read lands, and never changes a byte, so a restore that lands
before it finished is as correct as one after (only slower).

Every mode reports progress in the log (every 10 % or 5 s) and checks ``stop``
between chunks: SIGTERM during start-up stops within one chunk and the caller
unlinks what was created.
"""

from __future__ import annotations

import logging
import os
import time

from kvsidecar.shm import populate as P
from kvsidecar.shm.errors import SegmentError
from kvsidecar.shm.mapping_populator import PoolPopulator, cuda_device_without_torch
from kvsidecar.shm.segment import Segment, unlink_segment

log = logging.getLogger(__name__)

HUGE_PAGE = P.HUGE_PAGE
POPULATE_MODES = ("write", "map", "fallocate", "touch", "none")
HUGEPAGE_MODES = ("auto", "on", "off")
StartupInterrupted = P.Interrupted  # SIGTERM/SIGINT while the pool was being allocated


class _Progress:
    """Log lines for long allocations: every 10 % and at least every ``every_s``."""

    def __init__(self, name: str, what: str, every_s: float = 5.0):
        self.name, self.what, self.every_s = name, what, every_s
        self.t0 = self.last_t = time.monotonic()
        self.next_pct = 10

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        pct = 100 * done // max(total, 1)
        if pct >= self.next_pct or now - self.last_t >= self.every_s:
            if done < total:
                log.info("pool %s: %s %d%% (%d of %d MiB, %.1f s)", self.name, self.what, pct, done >> 20,
                         total >> 20, now - self.t0)
            self.last_t = now
            self.next_pct = (pct // 10 + 1) * 10


def populate_threads(cfg) -> int:
    n = cfg.pool.populate_threads
    return n if n > 0 else max(1, min(os.cpu_count() or 1, 8))


def _mode(cfg) -> str:
    return cfg.pool.populate if cfg.pool.prefault else "none"


def _initializer(mode: str, huge: bool, name: str, stop):
    """``init(fd, size)`` for Segment.create*: the allocation that goes through the file."""
    if mode == "write" and not huge:
        return lambda fd, size: P.fill_zeros(fd, size, stop=stop, progress=_Progress(name, "allocating"))
    if mode in ("write", "map", "fallocate"):
        return lambda fd, size: P.fallocate(fd, size, stop=stop, progress=_Progress(name, "allocating"))
    return None


def _check_stop(stop, progress):
    def cb(done, total):
        if stop is not None and stop.is_set():
            raise StartupInterrupted("pre-fault interrupted")
        progress(done, total)
    return cb


def _create(cfg, size: int, stop) -> tuple[Segment, str]:
    """The segment with its pages allocated as ``pool.populate`` says; and a word on the backing."""
    mode = _mode(cfg)
    want = cfg.pool.hugepages
    huge_size = P.round_up(size, HUGE_PAGE)  # hugetlb sizes are whole pages
    if cfg.pool.hugepage_dir and want != "off":
        path = f"{cfg.pool.hugepage_dir.rstrip('/')}/{cfg.instance}.pool"
        try:
            seg = Segment.create_file(path, huge_size, replace_stale=True,
                                      init=_initializer(mode, True, path, stop))
            return seg, f"hugetlbfs {cfg.pool.hugepage_dir}"
        except StartupInterrupted:
            raise
        except SegmentError as exc:
            if want == "on":
                raise
            log.warning("pool: cannot use huge pages in %s (%s); falling back to 4 KiB pages",
                        cfg.pool.hugepage_dir, exc)
    elif want != "off":
        avail = P.hugepages_available()
        if avail >= huge_size:
            label = f"{cfg.instance}.pool"
            try:
                seg = Segment.create_memfd(label, huge_size, hugetlb=True,
                                           init=_initializer(mode, True, label, stop))
                return seg, "memfd MFD_HUGETLB"
            except StartupInterrupted:
                raise
            except SegmentError as exc:
                if want == "on":
                    raise
                log.warning("pool: %d MiB of 2 MiB pages looked free but allocating them failed (%s); "
                            "falling back to 4 KiB pages", avail >> 20, exc)
        elif want == "on":
            raise SegmentError(f"pool.hugepages = on, but only {avail >> 20} MiB of 2 MiB pages are free "
                               f"({huge_size >> 20} MiB needed; raise vm.nr_hugepages)")
        else:
            log.info("pool: 4 KiB pages: huge pages unavailable (%d MiB of 2 MiB pages free, %d MiB needed; "
                     "set vm.nr_hugepages, or pool.hugepages = \"off\" to skip this check)",
                     avail >> 20, huge_size >> 20)
    unlink_segment(cfg.pool_name)
    seg = Segment.create(cfg.pool_name, size, init=_initializer(mode, False, cfg.pool_name, stop))
    return seg, "/dev/shm"


def create_pool_segment(cfg, size: int, stop=None) -> Segment:
    """Create and allocate the pool; ``stop`` (an Event) interrupts it with StartupInterrupted."""
    t0 = time.monotonic()
    mode = _mode(cfg)
    seg, backing = _create(cfg, size, stop)
    try:
        how = mode
        if mode == "map":
            n = populate_threads(cfg)
            used = seg.populate(threads=n, stop=stop, progress=_Progress(seg.name, f"mapping ({n} threads)"))
            how = f"map, {n} threads" + (", touch fallback" if used == "touch" else "")
        elif mode == "touch":
            seg.prefault(_check_stop(stop, _Progress(seg.name, "pre-faulting")))
    except BaseException:
        seg.unlink()
        seg.close()
        raise
    dt = time.monotonic() - t0
    gib = seg.size / (1 << 30)
    if mode == "none":
        log.warning("pool %s: populate=none reserves nothing: if %s fills up, the first touch of a page is a "
                    "SIGBUS in whichever process touches it (use the default \"fallocate\")", seg.name, backing)
    log.info("pool %s ready: %d MiB, %s pages (%s), populate=%s, in %.3f s (%.3f s/GiB)", seg.name,
             seg.size >> 20, "2 MiB" if seg.page_size >= HUGE_PAGE else "4 KiB", backing, how, dt,
             dt / gib if gib else 0.0)
    return seg


class SidecarPoolPopulator(PoolPopulator):
    """The sidecar's background populate of its own pool mapping (see the module docstring).

    The CUDA device is found on the populate thread (loading a CUDA runtime and asking it
    for devices takes a while), never on the control thread."""

    log = log

    def __init__(self, segment, cuda_register: str = "auto", chunk: int = 16 << 20):
        super().__init__(segment, chunk=chunk)
        self.cuda_register = cuda_register

    def run(self) -> None:
        try:
            self.cuda_device = cuda_device_without_torch(self.cuda_register)
        except Exception as exc:  # a broken CUDA install: populate with madvise
            self.log.warning("pool.cuda_register: probing CUDA failed (%s); populating instead", exc)
            self.cuda_device = None
        self.method = "cudaHostRegister" if self.cuda_device is not None else "madvise"
        super().run()


def sidecar_populator(cfg, seg: Segment, l3_on: bool) -> SidecarPoolPopulator | None:
    """The background populate ``pool.sidecar_populate`` asks for (not started), or None."""
    mode = cfg.pool.sidecar_populate
    if mode == "off" or (mode == "auto" and not l3_on):
        return None
    return SidecarPoolPopulator(seg, cfg.pool.cuda_register)


def hugetlbfs_mount(need_bytes: int) -> str | None:
    """A hugetlbfs mount with enough free 2 MiB pages for ``need_bytes``, or None."""
    mounts = P.hugetlbfs_mounts()
    return mounts[0] if mounts and P.hugepages_available() >= need_bytes else None
