"""The read-only inspector: its versioned JSON schema, its sections, and ``--watch`` in a real
terminal (tmux) showing a live session and a lease while they exist and their absence after."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar import inspector

from ..helpers import file_l3_overrides, fill_l3, small_kv
from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 48
TOKENS = list(range(4 * N))


def overrides(tmp_path, **extra):
    return file_l3_overrides(tmp_path, LAY, 160, **extra)


@pytest.fixture
def l3_chain(sidecar_factory, instance, tmp_path):
    """The test chain written to the file store through one sidecar (then stopped)."""
    return fill_l3(sidecar_factory, instance, LAY, overrides(tmp_path), small_kv(N), TOKENS)


# -- a validator for the JSON Schema subset inspector.SCHEMA uses -------------------------------
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def schema_errors(doc, schema, where="$") -> list:
    errs = []
    if "const" in schema and doc != schema["const"]:
        errs.append(f"{where}: {doc!r} != {schema['const']!r}")
    if "oneOf" in schema:
        if sum(not schema_errors(doc, s, where) for s in schema["oneOf"]) != 1:
            errs.append(f"{where}: matches not exactly one of oneOf")
    t = schema.get("type")
    if t is not None and not any(_is(doc, x) for x in ([t] if isinstance(t, str) else t)):
        return errs + [f"{where}: {type(doc).__name__} is not {t}"]
    if isinstance(doc, dict):
        for key in schema.get("required", ()):
            if key not in doc:
                errs.append(f"{where}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                errs += schema_errors(doc[key], sub, f"{where}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            errs += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errs


def published(instance, pred, timeout_s=20.0) -> dict:
    """The inspector's view once ``pred(view)`` holds (the tables are published after work)."""
    return wait_until(lambda: inspector.snapshot(instance), timeout_s, "the inspector's published view", until=pred)


def test_json_schema_with_a_session_and_a_lease(sidecar_factory, instance, tmp_path, l3_chain):
    sidecar_factory(**overrides(tmp_path, **{"sessions.retained_ttl_s": 60.0}))
    with KVConnector(instance, LAY, group="insp") as c:
        c.prefetch(l3_chain, "req-json", policy="wait_complete")
        view = published(instance, lambda v: v["leases"]["total"] == 1 and v["sessions"]["total"] == 1)
        assert schema_errors(view, inspector.SCHEMA) == []
        assert view["schema"] == "kvsidecar.inspect/1" == inspector.SCHEMA_ID
        (s,) = view["sessions"]["rows"]
        assert (s["request"], s["group"], s["policy"], s["state"], s["status"]) == \
            ("req-json", "insp", "wait_complete", "terminal", "complete")
        assert s["published"] == s["target"] == s["total"] == N
        (lease,) = view["leases"]["rows"]
        assert lease["kind"] == "prefetch" and lease["blocks"] == N and lease["owner"] == f"session {s['session']}"
        pool = view["pool"]
        assert pool["by_state"]["resident_pinned"] == N and sum(pool["by_state"].values()) == pool["blocks"] == 160
        assert pool["pinned_bytes"] == N * LAY.block_bytes
        (me,) = view["clients"]
        assert me["group"] == "insp" and me["rank"] == 0 and me["requests"] >= 2 and me["requests_per_s"] > 0
        # the command line prints the same document (validated as a consumer would)
        r = subprocess.run([sys.executable, "-m", "kvsidecar.sidecar.inspector", "--instance", instance, "--json"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert schema_errors(doc, inspector.SCHEMA) == [] and doc["leases"]["total"] == 1
        text = inspector.render(view)
        for section in ("SESSIONS (1)", "LEASES (1)", "POOL", "CLIENTS (1 of"):
            assert section in text
        assert "req-json" in text and "resident_pinned" in text and "#" in text
        lease = c.get(l3_chain, req="req-json", step=1)  # hands off; then released
        c.release(lease)
    # the validator itself can fail: a wrong type, a missing field, a wrong version
    bad = json.loads(json.dumps(view))
    bad["sessions"]["rows"][0]["published"] = "48"
    del bad["clients"][0]["pid"]
    bad["schema"] = "kvsidecar.inspect/0"
    errs = schema_errors(bad, inspector.SCHEMA)
    assert len(errs) == 3 and any("published" in e for e in errs) and any("'pid'" in e for e in errs)


def _tmux(sock, *args) -> str:
    r = subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _screen_until(sock, pred, what: str, timeout_s: float = 20.0) -> str:
    return wait_until(lambda: _tmux(sock, "capture-pane", "-p", "-t", "w"), timeout_s, f"{what} on the screen",
                      until=pred)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it)")
def test_watch_in_tmux_shows_live_session_and_lease_then_their_absence(sidecar_factory, instance, tmp_path,
                                                                       l3_chain):
    # slow reads (0.2 s per 2-block chunk): the session runs for seconds, long enough to be seen
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 200.0, "sessions.retained_ttl_s": 1.0}))
    sock = f"kvsinsp{uuid.uuid4().hex[:8]}"
    cmd = f"{sys.executable} -m kvsidecar.sidecar.inspector --instance {instance} --watch 0.1"
    _tmux(sock, "new-session", "-d", "-s", "w", "-x", "150", "-y", "60", "-c", str(ROOT), cmd)
    try:
        _screen_until(sock, lambda s: "(no sessions)" in s and "(no leases)" in s, "an empty sidecar")
        with KVConnector(instance, LAY, group="tmux") as c:
            c.prefetch(l3_chain, "req-live", policy="best_effort", chunk_max_blocks=2)
            screen = _screen_until(sock, lambda s: "req-live" in s and " running " in s, "a running session")
            assert "SESSIONS (1)" in screen and "best_effort" in screen
            c.demand("req-live")  # best_effort stops: its prefix goes under a prefetch lease
            screen = _screen_until(sock, lambda s: "LEASES (1)" in s and " prefetch " in s, "the prefetch lease")
            assert "demanded" in screen and "session " in screen
            lease = c.get(l3_chain, req="req-live", step=1)  # the hand-off: a GET lease replaces it
            screen = _screen_until(sock, lambda s: "LEASES (1)" in s and " get " in s, "the GET lease")
            assert " prefetch " not in screen.split("LEASES")[1].split("POOL")[0]
            c.release(lease)
            # released, and the terminal session forgotten after retained_ttl_s: both absent
            screen = _screen_until(sock, lambda s: "(no leases)" in s and "(no sessions)" in s,
                                   "the lease and the session gone")
            assert "req-live" not in screen
            assert screen.count("kvsidecar-inspect --watch") == 1  # redrawn in place: one frame, not scrolled
            assert "CLIENTS (1 of" in screen  # the inspector holds no slot: only our connector
        _screen_until(sock, lambda s: "CLIENTS (0 of" in s, "the client gone")
        _tmux(sock, "send-keys", "-t", "w", "C-c")
        wait_until(lambda: subprocess.run(["tmux", "-L", sock, "has-session", "-t", "w"],
                                          capture_output=True).returncode != 0, 10, "the watch ending on Ctrl-C")
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, timeout=30)


def test_tables_stay_bounded_with_many_sessions_and_long_names(sidecar_factory, instance, tmp_path):
    """60 sessions with 250-character request ids: 48 rows, names cut, the total still 60, and
    the published blob (a fixed region of the control segment) is never replaced by 'truncated'."""
    sidecar_factory(**overrides(tmp_path, **{"l3.backend": "none", "sessions.retained_ttl_s": 60.0}))
    with KVConnector(instance, LAY, group="g" * 200) as c:
        chain = c.hasher.chain(TOKENS)
        for i in range(60):
            c.prefetch(chain, f"{i:03d}" + "x" * 247, policy="timeout")
        view = published(instance, lambda v: v["sessions"]["total"] == 60)
    assert schema_errors(view, inspector.SCHEMA) == [] and "truncated" not in view["stats"]
    rows = view["sessions"]["rows"]
    assert len(rows) == 48 and all(len(r["request"]) == 64 and len(r["group"]) == 64 for r in rows)
    assert [r["request"][:3] for r in rows] == [f"{i:03d}" for i in range(59, 11, -1)]  # all ended: newest first
    assert all(r["status"] == "no_hit" for r in rows)
    assert "... 12 more" in inspector.render(view)
