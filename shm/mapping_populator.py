"""One process's own mapping of the pool, made fault-free in the background (mechanism only).

Every process pays page-table faults the first time it touches a page of its
mapping, even when another process already allocated the page.  Two users share
this mechanism (``sidecar/`` and ``connector/`` never import each other; this is
``shm/``): a connector at attach (the rank's copies), and the sidecar after it is
ready when an L3 backend lands restores in the pool.  One background thread gives
every page of the mapping its page-table entry (``MADV_POPULATE_READ`` through ctypes, so the GIL
is released and the engine thread keeps running), in address order, in chunks,
so a restore that comes later never faults.

On CUDA the same thread instead ``cudaHostRegister``s the mapping (which pins and
thereby populates every page) and logs how long that took; the copier then uses
the registration instead of registering inside the first restore.  Registration
goes through the ``libcudart`` the process already loaded, via ctypes (no GIL),
falling back to torch's binding.

The populate gives way to the owner's own copies: while a load or save runs (an
L3 read in the sidecar), inside ``copying()``, the thread pauses before its next
chunk.  Two threads faulting the
same mapping slow each other down (measured: a first pass racing the populate ran
slower than one without it), so a restore that comes before the populate finished
runs as it would without one, and every restore after it finds its pages mapped.

``stop()`` ends the thread within one chunk (detach calls it before unmapping).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from kvsidecar.shm import populate as P
from kvsidecar.shm.errors import SegmentError

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1


class PoolPopulator:
    """Background populate (or CUDA registration) of one mapping; see the module docstring.

    Populating never changes a byte (read faults map the file's pages as they are), so
    data that lands in a page before, while or after the thread reaches it stays intact."""

    log = log  # subclasses log under their owner's name

    def __init__(self, segment, *, cuda_device: int | None = None, chunk: int = P.DEFAULT_CHUNK,
                 registrar=None):
        self.segment = segment
        self.cuda_device = cuda_device
        self.chunk = chunk
        self._registrar = registrar  # (address, size, device) -> None; tests inject one
        self._stop = threading.Event()
        self._done = threading.Event()
        self._registered = threading.Event()  # the CUDA registration attempt (if any) is over
        self._idle = threading.Event()  # clear while the engine copies: the populate waits
        self._idle.set()
        self._copies = 0
        self._copies_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.method = "cudaHostRegister" if cuda_device is not None else "madvise"
        self.done_bytes = 0
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self.cuda_registered = False

    # -- control --------------------------------------------------------------------------------
    def start(self) -> "PoolPopulator":
        self._thread = threading.Thread(target=self.run, name="kvsidecar-pool-populate", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop (within one chunk; a CUDA registration in progress runs to its end) and join."""
        self._stop.set()
        self._idle.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("pool populate thread did not stop within %.1f s", timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the populate (or registration) finished, failed or was stopped."""
        return self._done.wait(timeout_s)

    def wait_registration(self, timeout_s: float | None = None) -> bool:
        """True once the CUDA registration attempt is over (success: ``cuda_registered``)."""
        return self._registered.wait(timeout_s)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def copying(self):
        """Context manager around an engine copy: the populate pauses until it ends."""
        return _Copying(self)

    def _enter_copy(self) -> None:
        with self._copies_lock:
            self._copies += 1
            self._idle.clear()

    def _exit_copy(self) -> None:
        with self._copies_lock:
            self._copies -= 1
            if self._copies == 0:
                self._idle.set()

    def stats(self) -> dict:
        return {"method": self.method, "done": self.done, "bytes": self.done_bytes, "size": self.segment.size,
                "seconds": self.seconds, "error": None if self.error is None else str(self.error),
                "cuda_registered": self.cuda_registered}

    # -- work -----------------------------------------------------------------------------------
    def run(self) -> None:
        t0 = time.monotonic()
        seg = self.segment
        try:
            if self.cuda_device is not None:
                try:
                    self._register_cuda()
                    self.done_bytes = seg.size
                except Exception as exc:  # fall back: populate now, the copier registers lazily
                    self.log.warning("cudaHostRegister of the pool mapping failed (%s); populating instead", exc)
                    self.method = "madvise"
                finally:
                    self._registered.set()
            if not self.cuda_registered:
                self._populate()
            self.seconds = time.monotonic() - t0
            gib = seg.size / (1 << 30)
            self.log.info("pool mapping %s: %.2f GiB %s in %.3f s (%.3f s/GiB)", seg.name, gib,
                     "registered with CUDA (cudaHostRegister)" if self.cuda_registered else f"populated ({self.method})",
                     self.seconds, self.seconds / gib if gib else 0.0)
        except P.Interrupted:
            self.seconds = time.monotonic() - t0
        except SegmentError as exc:
            self.error = exc
            self.seconds = time.monotonic() - t0
            self.log.warning("pool mapping %s: populate failed after %.3f s: %s", seg.name, self.seconds, exc)
        finally:
            self._registered.set()
            self._done.set()

    def _populate(self) -> None:
        """Chunk by chunk in address order, pausing while the engine copies."""
        seg = self.segment
        for off in range(0, seg.size, self.chunk):
            self._idle.wait()
            if self._stop.is_set():
                raise P.Interrupted("populate stopped")
            n = min(self.chunk, seg.size - off)
            try:
                P.populate(seg.address + off, n, chunk=n)
            except P.PopulateUnsupported:
                self.method = "touch"
                P.touch(seg.address + off, n, write=False, chunk=n)
            self.done_bytes = off + n

    def _register_cuda(self) -> None:
        seg = self.segment
        if self._registrar is not None:
            self._registrar(seg.address, seg.size, self.cuda_device)
        else:  # pragma: no cover - needs a GPU
            _cuda_host_register(seg.address, seg.size, self.cuda_device)
        self.cuda_registered = True


class _Copying:
    __slots__ = ("p",)

    def __init__(self, populator: PoolPopulator):
        self.p = populator

    def __enter__(self):
        self.p._enter_copy()
        return self

    def __exit__(self, *exc):
        self.p._exit_copy()


# -- CUDA (runs only where a GPU exists) --------------------------------------------------------
def _loaded_cudart():  # pragma: no cover
    """The libcudart this process already loaded (torch's), as a ctypes handle, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _find_cudart():
    """A libcudart this process can load (already loaded, else from the loader's path), or None."""
    lib = _loaded_cudart()
    if lib is not None:
        return lib
    import ctypes.util

    names = [n for n in (ctypes.util.find_library("cudart"),) if n] + ["libcudart.so", "libcudart.so.12",
                                                                       "libcudart.so.13", "libcudart.so.11.0"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_device_without_torch(mode) -> int | None:
    """The CUDA device for a process that does not use torch (the sidecar): ``mode`` "auto" =
    device 0 when a CUDA runtime loads and reports a device, "on" = the same but a failure is
    logged as a warning, "off" = never."""
    if mode in (False, "off"):
        return None
    lib = _find_cudart()
    if lib is None:
        if mode in (True, "on"):
            log.warning("cuda_register = on, but no CUDA runtime (libcudart) could be loaded")
        return None
    count = ctypes.c_int(0)
    try:
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        rc = lib.cudaGetDeviceCount(ctypes.byref(count))
    except (AttributeError, OSError):  # pragma: no cover - a broken install
        return None
    if rc != 0 or count.value < 1:
        if mode in (True, "on"):
            log.warning("cuda_register = on, but the CUDA runtime reports no device (cudaError %d)", rc)
        return None
    return 0


def _cuda_host_register(address: int, size: int, device: int) -> None:  # pragma: no cover
    lib = _find_cudart()
    if lib is not None:
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rc = lib.cudaSetDevice(device)
        if rc == 0:
            rc = lib.cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister failed (cudaError {rc})")
        return
    import torch  # holds the GIL while it registers: still off the engine's critical path

    torch.cuda.set_device(device)
    rc = torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({rc})")


def cuda_device_for_attach(mode) -> int | None:
    """The CUDA device to register on at attach: ``mode`` "auto" = when this process already
    initialised CUDA through torch (an engine with GPU KV caches), True = always, False = never."""
    if mode is False or mode == "off":
        return None
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        if mode is True or mode == "on":
            import torch
        else:
            return None
    try:
        if mode in ("auto",) and not torch.cuda.is_initialized():
            return None
        if not torch.cuda.is_available():
            return None
        return torch.cuda.current_device()
    except Exception:  # pragma: no cover - a broken CUDA install: CPU behaviour
        return None
