"""Exception types every caller can catch, and the wire error codes they map to."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Codes carried in the ``err`` field of an error completion."""

    MALFORMED = 1  # not a msgpack map, or a field of the wrong type
    BAD_VERSION = 2  # protocol version the sidecar does not speak
    UNKNOWN_OP = 3
    TOO_LARGE = 4  # frame, chain or string over its bound
    BAD_FIELD = 5  # a field present but out of range / inconsistent
    NOT_ATTACHED = 6  # op before a successful attach on this slot
    LAYOUT_MISMATCH = 7
    UNKNOWN_ID = 8  # unknown lease / staging / session id
    NOT_OWNER = 9  # a client acting on something another client owns
    LIMIT = 10  # a reserved / pinned byte limit or pool capacity refused it
    BUSY = 11
    SHUTTING_DOWN = 12
    INTERNAL = 13
    L3_ERROR = 14


class KvSidecarError(Exception):
    """Base of every error this package raises on purpose."""


class UnavailableCause(enum.Enum):
    """Why a call could not reach a sidecar (``SidecarUnavailable.cause``): what the connector's
    reconnect policy (``kvsidecar.connector.reconnect``) decides its next step from."""

    NOT_RUNNING = "not_running"  # no sidecar serves the instance: no segment, a stale one, starting or stopping
    RESTARTED = "restarted"  # the incarnation this connection attached to died, is stopping, or was replaced
    SLOTS_EXHAUSTED = "slots_exhausted"  # every client slot of the control segment is taken
    TIMED_OUT = "timed_out"  # a live sidecar did not answer, or drain the submit ring, before the deadline
    REFUSED = "refused"  # incompatible: protocol version, segment format, or the attach was refused
    BROKEN = "broken"  # this connection is unusable: a ring failed validation, or it is not attached


class SidecarUnavailable(KvSidecarError):
    """The sidecar could not serve this call; ``cause`` (an :class:`UnavailableCause`) says why.

    The engine treats this as a miss and recomputes; a connector can re-attach.  Every failure
    of the transport is one (``SidecarBusy`` and ``RequestTimeout`` are subclasses); an error
    reply from a live sidecar is a :class:`RemoteError` instead.
    """

    default_cause = UnavailableCause.NOT_RUNNING

    def __init__(self, message: str = "", cause: UnavailableCause | None = None):
        super().__init__(message)
        self.cause = cause if cause is not None else self.default_cause


class SidecarBusy(SidecarUnavailable):
    """No client slot was free (cause ``SLOTS_EXHAUSTED``), or back-pressure did not clear before
    the caller's deadline (a full submit ring: ``TIMED_OUT``)."""

    default_cause = UnavailableCause.SLOTS_EXHAUSTED


class SegmentError(KvSidecarError):
    """A shared-memory segment is missing, malformed, or of the wrong version."""


class ProtocolError(KvSidecarError):
    """A frame failed to decode or validate.  ``code`` is an :class:`ErrorCode`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class RemoteError(KvSidecarError):
    """The sidecar answered a request with an error completion."""

    def __init__(self, code: int, message: str, op: str = ""):
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"E{code}"
        super().__init__(f"{op + ': ' if op else ''}{name}: {message}")
        self.code = code
        self.message = message
        self.op = op

    @property
    def code_name(self) -> str:
        try:
            return ErrorCode(self.code).name
        except ValueError:
            return f"E{self.code}"


class CorruptBlock(KvSidecarError):
    """A leased block's bytes do not match the checksum its writer recorded: nothing was
    loaded from it (the engine recomputes from ``position``)."""

    def __init__(self, position: int, block: int, message: str = ""):
        super().__init__(message or f"block {block} (chain position {position}) does not match its checksum")
        self.position = position
        self.block = block


class RequestTimeout(SidecarUnavailable):
    """A live sidecar did not answer within the caller's deadline (cause ``TIMED_OUT``)."""

    default_cause = UnavailableCause.TIMED_OUT
