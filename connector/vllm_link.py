"""A connection to the sidecar that degrades to "miss" (vLLM's connector halves use one each).

Every call has a deadline (``call_timeout_s``).  When the sidecar is absent, dead or replaced,
:meth:`SidecarLink.call` returns the caller's default instead of raising, so vLLM recomputes
and never hangs; a lost connection is retried at most every ``reattach_every_s``, and only
while ``may_reattach()`` allows it (a worker defers it while a copy reads the old mapping).
A successful re-attach is a new sidecar generation: ``on_reattach()`` lets the owner forget
what the old one held (it released all of it when it died).
"""

from __future__ import annotations

import logging
import time

from kvsidecar.shm.errors import KvSidecarError, RemoteError

from .kv_client import KVConnector

log = logging.getLogger(__name__)


class SidecarLink:
    def __init__(self, conn: KVConnector, reattach_every_s: float, *, on_reattach=None,
                 may_reattach=None, clock=time.monotonic):
        self.conn = conn
        self.reattach_every_s = reattach_every_s
        self._on_reattach = on_reattach
        self._may_reattach = may_reattach or (lambda: True)
        self._clock = clock
        self._down_since: float | None = None
        self._ever_attached = False
        self.misses = 0  # calls answered with the default (sidecar unavailable or failing)
        self.errors = 0  # error replies from a live sidecar (typed; counted, then a miss)

    @property
    def attached(self) -> bool:
        return self.conn.client.attached

    def start(self) -> bool:
        """Attach now; False (logged) when the sidecar is not there."""
        try:
            self.conn.attach()
        except KvSidecarError as exc:
            level = logging.ERROR if isinstance(exc, RemoteError) else logging.WARNING
            log.log(level, "kvsidecar %r unavailable (%s): every lookup is a miss until it is back",
                    self.conn.client.instance, exc)
            self._down_since = self._clock()
            return False
        self._down_since = None
        if self._ever_attached and self._on_reattach is not None:
            self._on_reattach()
        self._ever_attached = True
        return True

    def ready(self) -> bool:
        if self.conn.client.attached:
            return True
        if self._down_since is not None and self._clock() - self._down_since < self.reattach_every_s:
            return False
        if not self._may_reattach():
            return False
        self.conn.close()
        return self.start()

    def call(self, fn, default=None):
        """``fn()``, or ``default`` when the sidecar cannot answer (never raises a sidecar error).

        A call that finds its sidecar dead or replaced re-attaches at once (a restarted
        sidecar serves the very call that noticed) and is tried once more."""
        if not self.ready():
            self.misses += 1
            return default
        for retry in (True, False):
            try:
                return fn()
            except RemoteError as exc:
                log.warning("kvsidecar refused %s (%s); treating it as a miss", exc.op, exc)
                self.errors += 1
                break
            except KvSidecarError as exc:
                if self.conn.client.attached:
                    log.warning("kvsidecar call failed (%s); treating it as a miss", exc)
                    break
                log.warning("kvsidecar connection lost (%s)", exc)
                self._down_since = self._clock()
                if not (retry and self._may_reattach()):
                    break
                self.conn.close()
                if not self.start():
                    break
        self.misses += 1
        return default

    def close(self) -> None:
        try:
            self.conn.detach()
        except KvSidecarError:
            self.conn.close()
