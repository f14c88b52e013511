"""The service contract: what a subsystem declares to the control loop, once, at mount.

A service (KV ops, L3 ops, prefetch sessions, later metrics) is an object with:

* ``ops()`` → ``{op name: handler(conn, msg) -> dict | DEFERRED}``; every name must have a
  schema in :data:`kvsidecar.shm.protocol.OP_SCHEMAS` (which also says whether the op needs a client
  attached with a KV layout) and be served by exactly one service;
* ``validate_attach(conn, msg)`` → raise :class:`OpError` to refuse a KV attach;
* ``client_gone(conn)`` → release what that client incarnation held (runs exactly once);
* ``snapshot()`` → its typed snapshot (``kvsidecar.sidecar.observe.snapshot``; None: nothing to
  show), taken on the control thread; the ``stats`` op, the inspector's tables and Prometheus all
  render from it (``stats()`` is its wire rendering);
* ``check()`` → ``""`` when its accounting invariants hold, else what broke.

Services never import the loop (``kvsidecar.sidecar.runtime.loop``): they get what they need of it — ``post``,
``call_at``, ``reply``, the client table — through the :class:`Host` they are given.  Handlers
run on the control thread and own their state without locks.
"""

from __future__ import annotations

from typing import Protocol

from kvsidecar.shm.errors import ErrorCode

DEFERRED = object()  # a handler's result meaning "the completion comes later, via Host.reply()"


class OpError(Exception):
    """Raised by an op handler to answer with a typed error completion."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Host(Protocol):
    """The control loop as a service sees it: what a service may use of
    :class:`~kvsidecar.sidecar.runtime.loop.ControlLoop`, which implements it (the simulators'
    virtual loops and the executor bench's fake loop stand in for it).  Services hold it as
    ``self.host``; only the composition root (``kvsidecar.sidecar.app.SidecarApp``, the process)
    holds the loop itself."""

    clients: dict  # slot -> ClientConn (read only)
    counters: object  # collections.Counter of the loop's and services' free-form counters

    def snapshot(self): ...  # the whole sidecar's SidecarSnapshot

    def post(self, fn, *args) -> None: ...

    def call_at(self, due: float, fn, *args) -> None: ...

    def reply(self, conn, rid: int, result: dict | None = None, error=None) -> bool: ...


class Service:
    """Defaults for the optional parts of the contract."""

    def ops(self) -> dict:
        return {}

    def validate_attach(self, conn, msg) -> None:
        return None

    def client_gone(self, conn) -> None:
        return None

    def snapshot(self):
        return None

    def stats(self) -> dict:
        snap = self.snapshot()
        return snap.stats() if snap is not None else {}

    def check(self) -> str:
        return ""
