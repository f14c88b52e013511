"""The L3 backend boundary (mechanism only; policy lives on the control thread).

In the spirit of vLLM's ``kv_offload``: the control thread decides *what* to look up,
load or store (``kvsidecar.sidecar.l3.tier``); a backend only moves bytes between the pool and
the remote tier and reports **per-block** results.  Backends are called from worker
threads, never from the control thread, and must return in bounded time.

Keys are strings built by the tier (namespace + layout fingerprint + block hash);
addresses point into the pool mapping; every block of a call has the same ``size``.
An object is the block's ``size`` bytes followed, when ``tails`` are given, by ``tail_size``
bytes from / to its own address (the block's checksum row, ``kvsidecar.sidecar.kv.checksums``): one
object, one transfer, written and read together.  An object whose stored size is not
``size + tail_size`` is a failed read, never a partial one.
"""

from __future__ import annotations

import abc

from kvsidecar.shm.errors import KvSidecarError


class L3Error(KvSidecarError):
    """The remote tier could not be set up or used at all (per-block failures are results)."""


class L3Backend(abc.ABC):
    name = "l3"
    max_batch = 1024  # keys per call (Mooncake's limit; others accept it too)

    def register_pool(self, address: int, size: int) -> None:
        """Called once per mapping the tier moves bytes from or to (the pool, the checksum
        table); zero-copy backends register each."""

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Per-key presence."""

    @abc.abstractmethod
    def read(self, keys: list[str], addrs: list[int], size: int, tails: list[int] | None = None,
             tail_size: int = 0) -> list[bool]:
        """Read each key's ``size`` bytes to its address (and its ``tail_size`` trailer to its
        tail address); True only when all of it landed."""

    @abc.abstractmethod
    def write(self, keys: list[str], addrs: list[int], size: int, tails: list[int] | None = None,
              tail_size: int = 0) -> list[bool]:
        """Write ``size`` bytes from each address (then ``tail_size`` from its tail address);
        True only when that key is durably stored."""

    def stats(self) -> dict:
        return {}

    def interrupt(self) -> None:
        """Cut artificial waits short before shutdown (real backends: nothing to do)."""

    def close(self) -> None:
        """Release connections; bounded in time."""


def batched(n: int, size: int):
    """``range`` slices of at most ``size`` items covering ``0..n``."""
    for start in range(0, n, size):
        yield start, min(n, start + size)
