"""The pool's bytes: one shared segment of ``num_blocks × block_bytes``, pre-faulted.

Default backing is POSIX shm (``/dev/shm/<instance>.pool``).  With
``pool.hugepage_dir`` set to a hugetlbfs mount, the pool is a file there instead
(2 MiB pages: far fewer page-table entries, so mapping, pre-faulting and tearing
down a large pool are cheaper).  Either way clients map it by the name published in
the control header; pages are touched once at start so first use is not a fault storm.
"""

from __future__ import annotations

import logging
import time

from shm.segment import Segment, unlink_segment

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def create_pool_segment(cfg, size: int) -> Segment:
    if cfg.pool.hugepage_dir:
        name = f"{cfg.pool.hugepage_dir.rstrip('/')}/{cfg.instance}.pool"
        size = (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # hugetlbfs sizes are whole pages
        seg = Segment.create_file(name, size, replace_stale=True)
    else:
        unlink_segment(cfg.pool_name)
        seg = Segment.create(cfg.pool_name, size)
    if cfg.pool.prefault:
        t0 = time.monotonic()
        step = max(size // 10, 1)
        marks = {"next": step}

        def progress(done, total):
            if done >= marks["next"] or done == total:
                log.info("pre-faulting pool %s: %d%% (%d MiB)", seg.name, 100 * done // total, done >> 20)
                marks["next"] += step

        seg.prefault(progress)
        log.info("pool %s: %d MiB pre-faulted in %.2f s", seg.name, size >> 20, time.monotonic() - t0)
    return seg


def hugetlbfs_mount(need_bytes: int) -> str | None:
    """A hugetlbfs mount with enough free 2 MiB pages for ``need_bytes``, or None."""
    try:
        with open("/proc/meminfo") as f:
            free = int(next(line for line in f if line.startswith("HugePages_Free")).split()[1])
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[2] == "hugetlbfs"]
    except (OSError, StopIteration):
        return None
    return mounts[0] if mounts and free * HUGE_PAGE >= need_bytes else None
