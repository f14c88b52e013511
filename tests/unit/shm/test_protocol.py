"""shm/protocol.py: schema validation and hostile input."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.shm import protocol as p
from kvsidecar.shm.errors import ErrorCode, ProtocolError


def req(**kw):
    msg = {"v": p.PROTOCOL_VERSION, "id": 7}
    msg.update(kw)
    return msgpack.packb(msg, use_bin_type=True)


def code_of(data, limits=p.DEFAULT_LIMITS):
    with pytest.raises(ProtocolError) as ei:
        p.decode_request(data, limits)
    return ei.value.code, ei.value.request_id


def test_round_trip():
    chain = bytes(range(48))  # three distinct keys (a repeated key is refused)
    m = p.decode_request(p.encode({"v": 1, "op": "lookup", "id": 3, "chain": chain}))
    assert m["chain"] == chain and m["id"] == 3
    enc = p.Encoder()
    assert p.decode_request(enc.encode({"v": 1, "op": "ping", "id": 1})) == {"v": 1, "op": "ping", "id": 1}


@pytest.mark.parametrize("data,code,rid", [
    (b"\xc1", ErrorCode.MALFORMED, None),
    (b"", ErrorCode.MALFORMED, None),
    (msgpack.packb([1, 2]), ErrorCode.MALFORMED, None),
    (msgpack.packb({"v": 1, "op": "ping"}), ErrorCode.MALFORMED, None),
    (msgpack.packb({"v": 1, "op": "ping", "id": -1}), ErrorCode.MALFORMED, None),
    (msgpack.packb({"v": 2, "op": "ping", "id": 4}), ErrorCode.BAD_VERSION, 4),
    (msgpack.packb({"op": "ping", "id": 4}), ErrorCode.BAD_VERSION, 4),
    (msgpack.packb({"v": True, "op": "ping", "id": 4}), ErrorCode.BAD_VERSION, 4),  # == 1, but not the int 1
    (msgpack.packb({"v": 1.0, "op": "ping", "id": 4}), ErrorCode.BAD_VERSION, 4),
    (msgpack.packb({"v": 1, "op": "nope", "id": 4}), ErrorCode.UNKNOWN_OP, 4),
    (msgpack.packb({"v": 1, "op": 5, "id": 4}), ErrorCode.UNKNOWN_OP, 4),
    (req(op="lookup"), ErrorCode.MALFORMED, 7),
    (req(op="lookup", chain=b"x" * 17), ErrorCode.MALFORMED, 7),
    (req(op="lookup", chain="not bytes"), ErrorCode.MALFORMED, 7),
    (req(op="lookup", chain=b"x" * 16 * 8193), ErrorCode.TOO_LARGE, 7),
    (req(op="release", lease=-5), ErrorCode.MALFORMED, 7),
    (req(op="release", lease=True), ErrorCode.MALFORMED, 7),
    (req(op="get", chain=b"", ns="x" * 300), ErrorCode.TOO_LARGE, 7),
    (req(op="prefetch", req="r", chain=b"", budget_s=-1.0), ErrorCode.BAD_FIELD, 7),
    (req(op="prefetch", req="r", chain=b"", checkpoints=[1, "a"]), ErrorCode.MALFORMED, 7),
    (req(op="poll_scan"), ErrorCode.MALFORMED, 7),
    (req(op="poll_scan", polls={"req": "a"}), ErrorCode.MALFORMED, 7),  # a map, not a list of maps
    (req(op="poll_scan", polls=["a"]), ErrorCode.MALFORMED, 7),
    (req(op="poll_scan", polls=[{"req": "a"}, {"eta_s": 1.0}]), ErrorCode.MALFORMED, 7),  # no req
    (req(op="poll_scan", polls=[{"req": "a", "eta_s": -1.0}]), ErrorCode.BAD_FIELD, 7),
    (req(op="poll_scan", polls=[{"req": "a", "demand": 1}]), ErrorCode.MALFORMED, 7),
    (req(op="poll_scan", polls=[{"req": "a", "waiting": -1}]), ErrorCode.MALFORMED, 7),  # requests behind: a count
    (req(op="poll", req="a", waiting=1.5), ErrorCode.MALFORMED, 7),
    (req(op="demand", req="a", waiting="3"), ErrorCode.MALFORMED, 7),
    (req(op="prefetch", req="r", chain=b"", waiting=True), ErrorCode.MALFORMED, 7),
    (req(op="poll_scan", polls=[{"req": "x" * 300}]), ErrorCode.TOO_LARGE, 7),
    (req(op="poll_scan", polls=[{"req": "a"}] * (p.MAX_SCAN + 1)), ErrorCode.TOO_LARGE, 7),
    (req(op="poll_scan", polls=[], until_ready="yes"), ErrorCode.MALFORMED, 7),
    (msgpack.packb({"v": 1, "op": "ping", "id": 1, 5: 1}), ErrorCode.MALFORMED, None),
    (msgpack.packb({"v": 1, "op": "ping", "id": 1, "x": msgpack.ExtType(1, b"a")}), ErrorCode.MALFORMED, None),
])
def test_bad_frames_get_typed_errors(data, code, rid):
    assert code_of(data) == (code, rid)


def test_poll_scan_entries_are_polls():
    polls = [{"req": "a", "eta_s": 0.5, "demand": True, "waiting": 2}, {"req": "b", "attempt": 2, "waiting": 1},
             {"req": "c", "eta_s": None}]
    m = p.decode_request(req(op="poll_scan", polls=polls, step=9, until_ready=True))
    assert m["polls"] == polls and m["step"] == 9
    assert p.decode_request(req(op="poll_scan", polls=[{"req": "a"}] * p.MAX_SCAN))["polls"][-1] == {"req": "a"}
    # the answer to a full scan of terminal views fits a frame
    view = {"session": 2**40, "state": "terminal", "policy": "cost_aware", "published": 8192, "target": 8192,
            "planned": 8192, "existed": False, "status": "complete", "prefix": 8192, "reason": "x" * 40,
            "lease": 2**40, "restored": 8192, "chunks": 512, "chunk_ms_max": 123.456, "transfer_ms_max": 123.456,
            "stop_ms": 12.345, "drain_ms": 12.345, "waiting": 2**40}
    p.encode(p.ok_completion(1, {"views": [view] * p.MAX_SCAN}))


def test_frame_size_bound():
    limits = p.Limits(max_frame_bytes=1024)
    assert code_of(b"\x80" * 2000, limits)[0] == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError):
        p.encode({"v": 1, "op": "ping", "id": 1, "payload": b"x" * 2000}, limits)


def test_error_completion_shape():
    c = p.error_completion(None, ErrorCode.BUSY, "m" * 1000)
    assert c["id"] == -1 and c["ok"] is False and c["err"] == ErrorCode.BUSY and len(c["msg"]) == 500


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_protocol_error(data):
    try:
        p.decode_request(data)
    except ProtocolError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(p.OP_SCHEMAS)), st.dictionaries(st.sampled_from(
    ["chain", "lease", "req", "ns", "max_blocks", "payload", "staging", "ok", "budget_s", "checkpoints",
     "instance", "group", "rank", "group_size", "pid", "start", "layout", "attempt", "step", "demand",
     "polls", "until_ready"]), _values, max_size=6))
def test_structured_fuzz_never_crashes(op, fields):
    msg = {"v": 1, "op": op, "id": 1, **fields}
    try:
        data = msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        out = p.decode_request(data)
    except ProtocolError as exc:
        assert exc.request_id == 1
        return
    schema = p.OP_SCHEMAS[op]
    assert all(k in out for k in schema.required)
