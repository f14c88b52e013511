"""Named POSIX shared-memory segments with explicit ownership.

* The **owner** creates a segment (mode 0600, exclusive) and is the only one
  that unlinks it, exactly once (``unlink`` is idempotent on the object).
* **Attachers** map an existing segment by name, read-write or read-only.
* ``address`` is the base address of the mapping, for the native atomics and
  copies.  The mapping stays valid until ``close``; callers must not use
  addresses after that.
* A creator may pass ``init(fd, size)`` to allocate the pages through the file
  before it is mapped (``kvsidecar.shm.populate.fill_zeros`` / ``fallocate``); if ``init``
  raises, the segment is removed again.  ``populate`` maps every page into the
  calling process without a per-page Python loop (``kvsidecar.shm.populate``).
* ``create_memfd`` makes an anonymous segment (e.g. ``MFD_HUGETLB``) that others
  open as ``/proc/<owner pid>/fd/<n>``; it disappears with its last user.
"""

from __future__ import annotations

import logging
import mmap
import os

import posix_ipc

from kvsidecar._native.atomics import buffer_address

from . import populate as _populate
from .errors import SegmentError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def _posix_name(name: str) -> str:
    return name if name.startswith("/") else "/" + name


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, _posix_name(name)[1:]))


def unlink_segment(name: str) -> bool:
    """Remove a (possibly stale) segment by name; False when it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(_posix_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


def _size_and_map(fd: int, size: int, init, *, truncate: bool) -> tuple:
    """Give a new segment's fd its size, run ``init(fd, size)`` (allocation), map it:
    ``(mmap, page size)``.  The caller owns cleanup of the fd and name on failure."""
    if truncate:
        os.ftruncate(fd, size)
    if init is not None:
        init(fd, size)
    return mmap.mmap(fd, size), _page_size(fd)


def _page_size(fd: int) -> int:
    """The file system's page size for ``fd`` (2 MiB on hugetlbfs, else the base page)."""
    try:
        bsize = os.fstatvfs(fd).f_bsize
    except OSError:
        return _populate.PAGE
    return bsize if bsize > _populate.PAGE else _populate.PAGE


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, readonly: bool,
                 page_size: int = _populate.PAGE, fd: int | None = None):
        self.name = name
        self.size = size
        self.owner = owner
        self.readonly = readonly
        self.page_size = page_size  # 4 KiB, or 2 MiB for hugetlb-backed segments
        self._mm = mm
        self._fd = fd  # kept open only for memfd segments (others open it through /proc)
        self._unlinked = False
        # The memoryview is an export of the mmap: while it lives the mapping
        # cannot be closed under an address handed out below.
        self._view = memoryview(mm)
        self.address = buffer_address(self._view)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, size: int, *, replace_stale: bool = False, init=None) -> "Segment":
        """Create (exclusively) and map a new segment of ``size`` bytes, mode 0600.

        ``init(fd, size)``, when given, runs before the mapping is made (allocation)."""
        if size <= 0:
            raise SegmentError(f"segment {name}: size must be positive")
        pname = _posix_name(name)
        if replace_stale and unlink_segment(pname):
            log.warning("replaced stale segment %s", pname)
        try:
            shm = posix_ipc.SharedMemory(pname, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError as exc:
            raise SegmentError(f"segment {pname} already exists") from exc
        try:
            if init is not None:
                init(shm.fd, size)
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            unlink_segment(pname)
            raise
        shm.close_fd()
        return cls(name, size, mm, owner=True, readonly=False)

    @classmethod
    def create_file(cls, path: str, size: int, *, replace_stale: bool = False, init=None) -> "Segment":
        """Create a segment as a file (e.g. on a hugetlbfs mount), mode 0600; named by its path."""
        if replace_stale:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise SegmentError(f"segment {path} already exists") from exc
        try:
            mm, page = _size_and_map(fd, size, init, truncate=True)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):
                raise SegmentError(f"cannot map {path}: {exc}") from exc
            raise
        os.close(fd)
        return cls(path, size, mm, owner=True, readonly=False, page_size=page)

    @classmethod
    def create_memfd(cls, label: str, size: int, *, hugetlb: bool = False, init=None) -> "Segment":
        """An anonymous segment (``memfd_create``), named ``/proc/<pid>/fd/<n>`` for attachers.

        The fd stays open until ``unlink``/``close``; the memory is freed when the
        owner and every attacher have let go of it (nothing is left behind on a crash).
        With ``hugetlb`` it is backed by 2 MiB pages (``size`` must be a multiple)."""
        flags = os.MFD_CLOEXEC | (_populate.MFD_HUGETLB if hugetlb else 0)
        try:
            fd = os.memfd_create(label, flags)
        except OSError as exc:
            raise SegmentError(f"memfd_create({label!r}) failed: {exc.strerror}") from exc
        try:
            os.fchmod(fd, 0o600)
            mm, page = _size_and_map(fd, size, init, truncate=True)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise SegmentError(f"cannot map memfd {label!r}: {exc.strerror}") from exc
            raise
        return cls(f"/proc/{os.getpid()}/fd/{fd}", size, mm, owner=True, readonly=False, page_size=page, fd=fd)

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False) -> "Segment":
        """Map an existing segment by name (a path starting with a directory is a file)."""
        if name.count("/") > 1:
            return cls._attach_file(name, readonly)
        pname = _posix_name(name)
        flags = 0
        try:
            shm = posix_ipc.SharedMemory(pname, flags, read_only=readonly)
        except posix_ipc.ExistentialError as exc:
            raise SegmentError(f"segment {pname} does not exist") from exc
        try:
            size = shm.size
            if size <= 0:
                raise SegmentError(f"segment {pname} is empty")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(shm.fd, size, prot=prot)
        finally:
            shm.close_fd()
        return cls(name, size, mm, owner=False, readonly=readonly)

    @classmethod
    def _attach_file(cls, path: str, readonly: bool) -> "Segment":
        try:
            fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError as exc:
            raise SegmentError(f"segment {path} does not exist") from exc
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, size, prot=prot)
            page = _page_size(fd)
        finally:
            os.close(fd)
        return cls(path, size, mm, owner=False, readonly=readonly, page_size=page)

    # -- access -------------------------------------------------------------------------------
    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def mmap(self) -> mmap.mmap:
        return self._mm

    def populate(self, *, threads: int = 1, stop=None, progress=None, chunk: int = _populate.DEFAULT_CHUNK) -> str:
        """Give every page of this mapping a page-table entry (``MADV_POPULATE_READ``, which
        on a shared mapping maps pages writable; see :mod:`kvsidecar.shm.populate`), ``threads``
        workers, GIL released.

        Returns the method used: ``"madvise"``, or ``"touch"`` on kernels without
        MADV_POPULATE_* (each chunk read in C).  ``stop``/``progress`` as in
        :mod:`kvsidecar.shm.populate`."""
        if self._mm is None:
            raise SegmentError(f"segment {self.name} is closed")
        try:
            _populate.populate(self.address, self.size, threads=threads, stop=stop, progress=progress,
                               chunk=chunk)
            return "madvise"
        except _populate.PopulateUnsupported:
            _populate.touch(self.address, self.size, write=False, stop=stop, progress=progress, chunk=chunk)
            return "touch"

    def prefault(self, progress=None, chunk: int = 64 << 20) -> None:
        """Touch every page by writing zeros from Python, chunk by chunk (the original
        start-up loop; kept as the benchmark's baseline).  Only for fresh segments.

        ``progress(done_bytes, total_bytes)`` is called after each chunk.
        """
        if self.readonly:
            raise SegmentError("cannot prefault a read-only mapping")
        zero = bytes(chunk)
        done = 0
        while done < self.size:
            n = min(chunk, self.size - done)
            self._mm[done : done + n] = zero[:n]
            done += n
            if progress is not None:
                progress(done, self.size)

    def close(self) -> None:
        """Drop the mapping (idempotent).  The owner should ``unlink`` first or after."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._mm is None:
            return
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            log.warning("segment %s still has exported buffers; leaving it mapped", self.name)
            return
        self._mm = None

    def unlink(self) -> None:
        """Remove the name (owner only, exactly once; later calls are no-ops)."""
        if not self.owner:
            raise SegmentError("only the owner unlinks a segment")
        if not self._unlinked:
            self._unlinked = True
            if self._fd is not None:  # memfd: the name is our fd; attachers keep their own mappings
                os.close(self._fd)
                self._fd = None
            elif self.name.count("/") > 1:
                try:
                    os.unlink(self.name)
                except FileNotFoundError:
                    pass
            else:
                unlink_segment(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
