"""Bad input from one client gets a typed error before any state changes; nobody else is hurt.

Reproductions: a wrap marker at offset 0 of a client's own submit ring wedged the control
thread for every client; a chain with a repeated key broke the books (commit INTERNAL, exit 3
at shutdown); an attach whose layout map had bytes keys was answered INTERNAL.
"""

from __future__ import annotations

import os
import struct

import pytest

from kvsidecar.connector.client import SidecarClient
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar._native import atomics
from kvsidecar.shm.control import SLOT_FREE
from kvsidecar.shm.errors import ErrorCode, RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.shm.ring import WRAP_MARKER

from .rawslot import raw_slot

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)


def kv_overrides(**extra):
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": 64, "l3.backend": "none"})
    d.update(extra)
    return d


def books(c) -> dict:
    s = c.call("stats", check=True)
    assert s["invariants"] == "", s["invariants"]
    return s["stats"]


def test_wrap_marker_at_offset_zero_drops_only_the_attacker(sidecar, instance):
    good = SidecarClient(instance, group="good", timeout_s=5.0)
    good.attach()
    # The attacker claims a fresh slot by hand (head at data offset 0) and writes a wrap
    # marker at offset 0 with tail past it: a producer can never write that.
    with raw_slot(instance) as evil:
        struct.pack_into("<I", evil.submit.view, evil.submit.data_off + 0, WRAP_MARKER)
        atomics.store_release_u64(evil.submit.tail_addr, 64)
        evil.ctl.sidecar_doorbell.ring()
        for i in range(50):  # the control thread is not wedged: every call is answered
            assert good.call("ping", payload=b"%d" % i)["payload"] == b"%d" % i
        counters = good.call("stats")["stats"]["counters"]
        assert counters.get("errors_ring_corrupted") == 1
        assert evil.ctl.slot_state(evil.slot)[1] == SLOT_FREE  # the attacker was dropped, its slot freed
    good.detach()


def test_chain_with_a_repeated_key_is_refused_before_any_state_changes(sidecar_factory, instance):
    sidecar_factory(**kv_overrides())
    with KVConnector(instance, LAY) as c:
        good = c.hasher.chain(list(range(4 * 8)))
        keys = [good[i * 16:(i + 1) * 16] for i in range(8)]
        bad = b"".join(keys[:5] + [keys[2]] + keys[5:])
        before = books(c.client)
        for op, extra in (("store", {}), ("lookup", {}), ("get", {}), ("restore", {}),
                          ("prefetch", {"req": "r1"})):
            with pytest.raises(RemoteError) as ei:
                c.client.call(op, chain=bad, **extra)
            assert ei.value.code == ErrorCode.BAD_FIELD and "repeats" in ei.value.message, op
        after = books(c.client)
        assert after["pool"] == before["pool"] and after["leases"]["live"] == 0
        assert after["store"]["open"] == 0 and after["sessions"]["by_state"] == {}
        assert after["counters"].get("errors_bad_field") == 5
        assert after["counters"].get("errors_internal", 0) == 0
        # the same client still works with a good chain
        st = c.store(good)
        assert st.count == 8
        c.commit(st)
        assert c.lookup(good) == 8
        books(c.client)


def test_attach_with_bytes_keys_in_layout_is_malformed_not_internal(sidecar_factory, instance):
    sidecar_factory(**kv_overrides())
    bad_layouts = [{b"model": "x", "num_layers": 2}, {"model": {"nested": 1}}, {"model": [1, 2]},
                   {"k%d" % i: i for i in range(100)}]
    with raw_slot(instance) as c:
        for i, layout in enumerate(bad_layouts):
            c.request({"op": "attach", "id": 70 + i, "instance": instance, "group": "g", "rank": 0,
                       "group_size": 1, "pid": os.getpid(), "start": 0, "layout": layout})
        replies = c.replies(len(bad_layouts))
        assert [r["id"] for r in replies] == [70 + i for i in range(len(bad_layouts))]
        for r in replies:
            assert r["ok"] is False and r["err"] in (ErrorCode.MALFORMED, ErrorCode.TOO_LARGE), r
    with SidecarClient(instance) as obs:  # the sidecar serves on, and nothing was INTERNAL
        counters = obs.call("stats")["stats"]["counters"]
        assert counters.get("errors_internal", 0) == 0
        assert counters.get("errors_malformed", 0) + counters.get("errors_too_large", 0) == len(bad_layouts)
