"""Issue 20, end to end: a real SGLang server (CPU, tiny dummy-weight Llama, TP=2, the kvsidecar
plugin; ``test_full_server.py``'s set-up) with the sidecar's **default** ``transport.num_slots``,
doing ``/flush_cache`` + the same prompt again, 20+ times.  Every flush restarts the cache
controller's prefetch, I/O and backup threads on both ranks; before the fix each restart cost
every rank a few client slots until none were left and storage missed for good.

Every cycle must be a storage hit of the whole prompt (less SGLang's last page), with the output
of the cold run; the slots the server's processes hold are read live from the slot table (the
read-only inspector) before, during and after, and must stay bounded.  Odd cycles also flush
the sidecar's CPU pool, so those restores come from L3.  Slow (a server start): run with
``-m "sglang and slow"``.
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("sglang")

from kvsidecar.sidecar import inspector  # noqa: E402
from kvsidecar.sidecar.config import SidecarConfig  # noqa: E402
from tests.sglang.test_full_server import (  # noqa: E402,F401
    PAGE,
    TP,
    flush,
    generate,
    probe,
    server_factory,
    sidecar_overrides,
    storage_tokens,
    wait_published,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CYCLES = 20
PROMPT_TOKENS = 1024


def server_slots(instance) -> tuple[int, dict, int]:
    """(slots held by processes other than this test, {pid: slots}, refusals so far), read live."""
    view = inspector.snapshot(instance)
    held = {h["pid"]: h["slots"] for h in view["slots_by_pid"] if h["pid"] != os.getpid()}
    return sum(held.values()), held, view["sidecar"]["slot_exhaustions"]


def test_flush_cache_cycles_keep_hitting_storage(server_factory, instance, tmp_path):
    over = sidecar_overrides(tmp_path)
    assert not any(k.startswith("transport.") for k in over)  # the default slot count
    num_slots = SidecarConfig().transport.num_slots
    srv = server_factory(over, plugin=True)
    port = srv.port
    assert srv.log_path.read_text().count("kvsidecar plugin active") == TP
    rng = random.Random(20)
    warm = [rng.randrange(3, 500) for _ in range(64)]
    generate(port, warm)
    base = wait_published(instance, len(warm) // PAGE, 240, "the warm prompt's write-through")
    ids = [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]
    first, meta0 = generate(port, ids)  # the cold run
    wait_published(instance, base + len(ids) // PAGE, 60, "the prompt's write-through")
    before, held_before, refused_before = server_slots(instance)
    assert inspector.snapshot(instance)["sidecar"]["num_slots"] == num_slots
    rows = []
    for cycle in range(CYCLES):
        flush(port)  # SGLang's GPU and host tiers, and a reset of its cache controller's threads
        from_l3 = cycle % 2 == 1
        if from_l3:
            c = probe(instance, over)
            try:
                c.flush()  # the sidecar's CPU pool too: this restore reads L3
            finally:
                c.close()
        t0 = time.monotonic()
        out, meta = generate(port, ids, rid=f"flush-{cycle}")
        took = time.monotonic() - t0
        slots, held, refused = server_slots(instance)
        rows.append({"cycle": cycle, "storage": storage_tokens(meta), "same": out == first, "slots": slots,
                     "held": held, "refused": refused, "from_l3": from_l3, "s": round(took, 2)})
    after, held_after, refused_after = server_slots(instance)
    text = srv.log_path.read_text()
    table = "\n".join(f"  cycle {r['cycle']:>2} {'L3  ' if r['from_l3'] else 'pool'} storage {r['storage']:>5} "
                      f"tokens, same output {r['same']}, server slots {r['slots']} {r['held']}, {r['s']} s"
                      for r in rows)
    print(f"\nflush-cycle test (num_slots {num_slots}, cold run storage {storage_tokens(meta0)}): server slots "
          f"before {before} {held_before}, after {after} {held_after}, max {max(r['slots'] for r in rows)}; "
          f"refusals {refused_before} -> {refused_after}\n{table}")
    want = (len(ids) // PAGE - 1) * PAGE  # SGLang computes the prompt's last page itself
    assert all(r["same"] for r in rows), table
    assert all(r["storage"] >= want for r in rows), table  # every cycle a storage hit of the prompt
    assert len({r["storage"] for r in rows}) == 1, table
    cap = TP * 4  # kvsidecar.connector.sglang_config: max_connections = 4 per rank
    assert before >= TP and max(r["slots"] for r in rows) <= cap and after <= cap, table
    assert after <= num_slots - 2, table  # room left for other clients
    assert refused_after == refused_before == 0, table
    assert "storage misses" not in text and "client slots" not in text, text[-3000:]
