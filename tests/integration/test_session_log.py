"""One structured ``key=value`` line per terminal session on logger ``kvsidecar.sessions``,
from a real sidecar's log, matched against what each session's poll said."""

from __future__ import annotations


import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.observe.outcome import SessionOutcome
from kvsidecar.sidecar.observe.sessionlog import format_line, parse_line
from kvsidecar.sidecar.spawn import SidecarProcess

from ..helpers import file_l3_overrides, store_to_l3, wait_terminal
from ..waiting import wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 48
TOKENS = list(range(4 * N))
FIELDS = ["session", "request", "group", "policy", "status", "reason", "trigger", "blocks_target",
          "blocks_published", "blocks_restored", "blocks_withdrawn", "chunks", "elapsed_ms", "stop_ms", "drain_ms",
          "error"]


def overrides(tmp_path, **extra):
    return file_l3_overrides(tmp_path, LAY, 160, **extra)


def test_format_and_parse_round_trip_with_awkward_values():
    o = SessionOutcome(session=3, request="req with space", group="g=1", policy="cost_aware", status="failed",
                       reason="block read failed", trigger="", blocks_total=10, blocks_resident=2, blocks_target=9,
                       blocks_published=4, prefix=4, blocks_restored=2, blocks_withdrawn=3, chunks=2,
                       chunks_abandoned=0, elapsed_s=0.25, stop_latency_s=None, drain_s=0.0015)
    line = format_line(o)
    assert line.startswith("session=3 request=")
    f = parse_line(line)
    assert list(f) == FIELDS
    assert f["request"] == "req with space" and f["group"] == "g=1" and f["policy"] == "cost_aware"
    assert f["error"] == f["reason"] == "block read failed" and f["trigger"] == "-" and f["stop_ms"] == "-"
    assert f["elapsed_ms"] == "250.0" and f["drain_ms"] == "1.5" and f["blocks_withdrawn"] == "3"


def test_one_line_per_terminal_session(instance, tmp_path):
    torch.manual_seed(0)
    kv = [tuple(torch.randn(N, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as err:
        sp = SidecarProcess(instance, overrides=overrides(tmp_path), stderr=err)
        try:
            with KVConnector(instance, LAY) as c:
                chain, _ = store_to_l3(c, kv, TOKENS)
        finally:
            sp.stop()
        # slow reads: a short deadline cuts one session; another is aborted while it runs
        sp = SidecarProcess(instance, overrides=overrides(tmp_path, **{"l3.latency_ms": 30.0}), log_level="INFO",
                            stderr=err)
        try:
            with KVConnector(instance, LAY, group="logs") as c:
                views = {}
                c.prefetch(chain, "full", policy="wait_complete")
                views["full"] = wait_terminal(c, "full")
                c.release(c.get(chain, req="full", step=1))
                c.flush()
                c.prefetch(chain, "cut", policy="timeout", budget_s=0.05, chunk_max_blocks=4)
                views["cut"] = wait_terminal(c, "cut")
                c.flush()
                c.release(c.get(chain, req="cut", step=1))  # its result lease: now the pool can be flushed
                c.flush()
                c.prefetch(chain, "gone", policy="best_effort", chunk_max_blocks=4)
                # reading: one chunk in flight, one queued
                wait_until(lambda: c.poll("gone")["state"], 10, "'gone' running", until=lambda s: s == "running")
                c.abort("gone")
                views["gone"] = wait_terminal(c, "gone")
                stats = c.stats(check=True)
                assert stats["invariants"] == ""
        finally:
            assert sp.stop() == 0
    lines = [line.split("kvsidecar.sessions INFO ", 1)[1] for line in log_path.read_text().splitlines()
             if " kvsidecar.sessions INFO " in line]
    assert len(lines) == 3, lines  # exactly one per session, none for the warm-up's (no session ran)
    by_req = {f["request"]: f for f in map(parse_line, lines)}
    assert set(by_req) == {"full", "cut", "gone"}
    for req, f in by_req.items():
        v = views[req]
        assert list(f) == FIELDS
        assert f["group"] == "logs" and f["session"] == str(v["session"]) and f["status"] == v["status"]
        assert f["policy"] == v["policy"] and int(f["blocks_published"]) == v["published"]
        assert int(f["blocks_restored"]) == v["restored"] and int(f["chunks"]) == v["chunks"]
        assert int(f["blocks_target"]) == v["target"], (req, f, v)
        assert float(f["elapsed_ms"]) > 0
    full, cut, gone = by_req["full"], by_req["cut"], by_req["gone"]
    assert full["status"] == "complete" and full["trigger"] == "-" and full["stop_ms"] == "-"
    assert int(full["blocks_restored"]) == N and full["error"] == "-"
    assert cut["status"] == "timeout" and cut["trigger"] == "deadline" and float(cut["stop_ms"]) >= 0
    assert float(cut["drain_ms"]) >= 0 and int(cut["blocks_published"]) < N
    assert gone["status"] == "aborted" and gone["trigger"] == "abort" and gone["reason"] == "abort"
    # chunks queued behind the read in flight were withdrawn at the seal (never read), and counted
    assert int(gone["blocks_withdrawn"]) in (4, 8) and int(gone["blocks_published"]) <= N - 4
    assert sum(int(f["blocks_withdrawn"]) for f in by_req.values()) == stats["sessions"]["blocks_withdrawn"]
