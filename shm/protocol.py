"""The wire protocol: versioned msgpack maps with bounded, validated fields.

Every request is a map with ``v`` (``PROTOCOL_VERSION``), ``op``, ``id`` (the
client's sequence number) and the op's fields.  Every completion echoes ``id``
and carries ``ok: true`` plus result fields, or ``ok: false``, ``err`` (an
:class:`~kvsidecar.shm.errors.ErrorCode`) and ``msg``.  Hash chains travel as one bytes
blob of ``KEY_BYTES × n``.

Decoding never trusts the peer: msgpack's own length limits stop huge
containers before they are built, then every field is type- and range-checked
against the op's schema.  A failure raises :class:`~kvsidecar.shm.errors.ProtocolError`
carrying the request id when it could be read, so the sidecar can answer it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from kvsidecar._native.hashing import first_duplicate

from .chain import KEY_BYTES
from .errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1
_MAX_ID = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds enforced on decode (both directions)."""

    max_frame_bytes: int = 256 * 1024
    max_blocks: int = 8192  # per request: 8192 × 16 B = 128 KiB of chain
    max_str: int = 256
    max_map: int = 64
    max_list: int = 8192


DEFAULT_LIMITS = Limits()

_SCALARS = (int, float, bool, str)

# Field kinds.  (An ``OpSchema`` as a kind: a list of maps, each checked against that schema.)
INT, SINT, FLOAT, BOOL, STR, BYTES, CHAIN, MAP, INTLIST = range(9)


@dataclasses.dataclass(frozen=True)
class OpSchema:
    required: dict
    optional: dict = dataclasses.field(default_factory=dict)
    kv: bool = False  # needs a client attached with a KV layout (observers may not send it)


_TP = {"group": STR, "req": STR, "attempt": INT, "step": INT}

# One entry of a ``poll_scan``: what a ``poll`` of that request carries, less the shared ``step``.
POLL_ENTRY = OpSchema({"req": STR}, {"attempt": INT, "eta_s": FLOAT, "demand": BOOL, "waiting": INT})
MAX_SCAN = 256  # entries per poll_scan (its answer stays well inside a frame); longer queues go in pieces

# The op table: every op the sidecar serves, its fields, and whether it needs a KV attach.
# The control loop refuses to mount a handler for an op that is not here (kvsidecar.sidecar.service).
OP_SCHEMAS: dict[str, OpSchema] = {
    "attach": OpSchema(
        {"instance": STR, "group": STR, "rank": INT, "group_size": INT, "pid": INT, "start": INT},
        {"layout": MAP},
    ),
    "detach": OpSchema({}),
    "ping": OpSchema({}, {"payload": BYTES}),
    "stats": OpSchema({}, {"check": BOOL}),
    "lookup": OpSchema({"chain": CHAIN}, {"ns": STR, **_TP}, kv=True),
    "get": OpSchema({"chain": CHAIN}, {"ns": STR, "max_blocks": INT, **_TP}, kv=True),
    "release": OpSchema({"lease": INT}, kv=True),
    "store": OpSchema({"chain": CHAIN}, {"ns": STR, "l3": BOOL, **_TP}, kv=True),
    "commit": OpSchema({"staging": INT}, {"ok": BOOL, "sums": BYTES}, kv=True),
    "restore": OpSchema({"chain": CHAIN}, {"ns": STR}, kv=True),
    "flush": OpSchema({}, kv=True),
    "prefetch": OpSchema(
        {"req": STR, "chain": CHAIN},
        {"ns": STR, "attempt": INT, "policy": STR, "budget_s": FLOAT, "chunk_max_blocks": INT,
         "tokens": INT, "checkpoints": INTLIST, "checkpoint_every": INT, "group": STR, "step": INT,
         "eta_s": FLOAT, "prefill_s_per_block": FLOAT, "fixed_hit": BOOL, "waiting": INT},
        kv=True,
    ),
    # ``drain_s``: the engine admits the request within it -- a session the demand stops hands
    # over what has landed by then and leaves its later reads behind
    "demand": OpSchema({"req": STR}, {"attempt": INT, "drain_s": FLOAT, "waiting": INT}, kv=True),
    "abort": OpSchema({"req": STR}, {"attempt": INT}, kv=True),
    # ``waiting`` (prefetch, demand, poll): the queued requests this one's prefill would hold up (cost_aware)
    "poll": OpSchema({"req": STR}, {"attempt": INT, "step": INT, "eta_s": FLOAT, "demand": BOOL, "waiting": INT},
                     kv=True),
    "wait": OpSchema({"req": STR}, {"attempt": INT, "until": INT, "terminal": BOOL, "wait_s": FLOAT}, kv=True),
    # a scheduler's scan of its waiting queue in one round trip: each entry is a ``poll`` (same
    # step, same group decision), in order; with ``until_ready`` the scan stops after the first
    # entry whose session is ready to admit (terminal or unknown), as the scheduler's own scan does;
    # with ``get`` a terminal session it stops at is also leased, as a ``get`` of its chain would
    "poll_scan": OpSchema({"polls": POLL_ENTRY}, {"step": INT, "until_ready": BOOL, "get": BOOL}, kv=True),
}


class Encoder:
    """msgpack packing with a reused ``Packer`` (one per thread of use; not thread-safe)."""

    __slots__ = ("pack", "max_frame_bytes")

    def __init__(self, limits: "Limits" = None):
        self.pack = msgpack.Packer(use_bin_type=True).pack  # no size check: for a caller that checks
        self.max_frame_bytes = (limits or DEFAULT_LIMITS).max_frame_bytes

    def encode(self, msg: dict) -> bytes:
        data = self.pack(msg)
        if len(data) > self.max_frame_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes over {self.max_frame_bytes}")
        return data


# Decoding relies on msgpack's default limits, which are derived from the input
# length: no container or string can claim more elements or bytes than the frame
# holds, and the frame itself is bounded by ``max_frame_bytes`` (checked first),
# so a hostile frame cannot make the decoder allocate more than O(frame) memory.
# Map keys must be str/bytes (``strict_map_key``); ext types are rejected.
def _unpack(data):
    return msgpack.unpackb(data, ext_hook=_no_ext)


def _no_ext(code, data):
    raise ValueError("ext types are not part of the protocol")


def encode(msg: dict, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Pack a request or completion; refuses frames over ``max_frame_bytes``."""
    data = msgpack.packb(msg, use_bin_type=True)
    if len(data) > limits.max_frame_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes over {limits.max_frame_bytes}")
    return data


def _check(name: str, kind: int, value: Any, limits: Limits) -> None:
    t = type(value)
    if kind == INT:
        if t is not int or value < 0 or value > _MAX_ID:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a non-negative int")
    elif kind == SINT:
        if t is not int:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be an int")
    elif kind == FLOAT:
        if t is not float and t is not int:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a number")
        if not (value >= 0) or value > 1e9:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} out of range")
    elif kind == BOOL:
        if t is not bool:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a bool")
    elif kind == STR:
        if t is not str:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a string")
        if len(value) > limits.max_str:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} longer than {limits.max_str}")
    elif kind == BYTES:
        if t is not bytes:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be bytes")
    elif kind == CHAIN:
        if t is not bytes:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a bytes blob")
        if len(value) % KEY_BYTES:
            raise ProtocolError(ErrorCode.MALFORMED, f"chain length {len(value)} is not a multiple of {KEY_BYTES}")
        if len(value) > limits.max_blocks * KEY_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"chain of {len(value) // KEY_BYTES} blocks over {limits.max_blocks}")
        dup = first_duplicate(value)
        if dup >= 0:  # a chained hash never repeats; a repeat would alias two blocks of one request
            raise ProtocolError(ErrorCode.BAD_FIELD, f"chain repeats a key at block {dup}")
    elif kind == MAP:
        # a flat map of str keys to scalars (the layout description); nothing nested
        if t is not dict:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a map")
        if len(value) > limits.max_map:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has over {limits.max_map} entries")
        for k, v in value.items():
            if type(k) is not str or len(k) > limits.max_str:
                raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: keys must be strings")
            if type(v) not in _SCALARS or (type(v) is str and len(v) > limits.max_str):
                raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: value of {k!r} must be a scalar")
    elif kind == INTLIST:
        if t is not list or any(type(x) is not int or x < 0 for x in value):
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a list of non-negative ints")
        if len(value) > limits.max_blocks:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} longer than {limits.max_blocks}")
    elif type(kind) is OpSchema:
        if t is not list:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} must be a list of maps")
        if len(value) > MAX_SCAN:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has over {MAX_SCAN} entries")
        for i, entry in enumerate(value):
            if type(entry) is not dict:
                raise ProtocolError(ErrorCode.MALFORMED, f"{name}[{i}] must be a map")
            _check_fields(f"{name}[{i}]", kind, entry, limits)
    else:
        raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r} has no kind")  # (a schema bug)


def _check_fields(what: str, schema: OpSchema, msg: dict, limits: Limits) -> None:
    for name, kind in schema.required.items():
        if name not in msg:
            raise ProtocolError(ErrorCode.MALFORMED, f"{what}: missing field {name!r}")
        _check(name, kind, msg[name], limits)
    for name, kind in schema.optional.items():
        if name in msg and msg[name] is not None:
            _check(name, kind, msg[name], limits)


def decode_request(data, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Decode and validate one request frame; returns the map.

    Raises ProtocolError whose ``request_id`` attribute is the ``id`` when it
    could be read (else ``None``).
    """
    if len(data) > limits.max_frame_bytes:
        raise _err(ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes over {limits.max_frame_bytes}", None)
    try:
        msg = _unpack(data)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise _err(ErrorCode.MALFORMED, f"undecodable frame: {exc}", None) from None
    if type(msg) is not dict:
        raise _err(ErrorCode.MALFORMED, "request is not a map", None)
    rid = msg.get("id")
    if type(rid) is not int or rid < 0 or rid > _MAX_ID:
        raise _err(ErrorCode.MALFORMED, "missing or invalid id", None)
    v = msg.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # exactly the int: true and 1.0 compare equal to 1
        raise _err(ErrorCode.BAD_VERSION, f"protocol version {v!r}, sidecar speaks {PROTOCOL_VERSION}", rid)
    op = msg.get("op")
    schema = OP_SCHEMAS.get(op) if type(op) is str else None
    if schema is None:
        raise _err(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}"[:200], rid)
    try:
        _check_fields(op, schema, msg, limits)
    except ProtocolError as exc:
        exc.request_id = rid
        raise
    return msg


def decode_completion(data, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Decode a completion (sidecar → client); shape-checked, not schema-checked."""
    try:
        msg = _unpack(data)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable completion: {exc}") from None
    if type(msg) is not dict or type(msg.get("id")) is not int or type(msg.get("ok")) is not bool:
        raise ProtocolError(ErrorCode.MALFORMED, "completion lacks id/ok")
    return msg


def ok_completion(rid: int, result: dict) -> dict:
    """A success completion: ``result`` itself (the handler's fresh dict) with ``id`` and ``ok`` set.
    With :func:`error_completion`, the only places a completion is built (the sidecar's dispatch
    has these two lines written out: its request path runs cold after every idle gap)."""
    result["id"] = rid
    result["ok"] = True
    return result


def error_completion(rid, code: ErrorCode, message: str) -> dict:
    return {"id": rid if rid is not None else -1, "ok": False, "err": int(code), "msg": message[:500]}


def _err(code: ErrorCode, message: str, rid) -> ProtocolError:
    exc = ProtocolError(code, message)
    exc.request_id = rid
    return exc
