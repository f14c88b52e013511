"""Small test helpers shared by several test files (not fixtures)."""

from __future__ import annotations

from .waiting import wait_until  # noqa: F401  (shared: older imports take it from here)


def file_l3_overrides(tmp_path, lay, num_blocks: int, **extra) -> dict:
    """Sidecar ``--set`` overrides: ``lay``'s layout, a ``num_blocks`` pool, a file-store L3 under
    ``tmp_path`` (plus ``extra``)."""
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": num_blocks, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


def small_kv(n_blocks: int, seed: int = 0) -> list:
    """Engine KV for the small test layout (2 layers, K and V, 4 tokens x 2 heads x 16 dims)."""
    import torch

    torch.manual_seed(seed)
    return [tuple(torch.randn(n_blocks, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]


def fill_l3(start_sidecar, instance: str, lay, overrides: dict, kv, tokens) -> bytes:
    """Write ``tokens``' blocks to the file-store L3 through a sidecar started with
    ``start_sidecar(**overrides)``, which is then stopped; returns the chain."""
    from kvsidecar.connector.kv_client import KVConnector

    sp = start_sidecar(**overrides)
    with KVConnector(instance, lay) as c:
        chain, _ = store_to_l3(c, kv, tokens)
    sp.stop()
    return chain


def wait_l3_idle(conn, timeout_s: float = 20.0) -> dict:
    """Wait (bounded) until the sidecar has no L3 PUT in flight; returns those stats."""
    return wait_until(conn.stats, timeout_s, "no L3 PUT in flight", until=lambda s: not s["l3"]["puts_in_flight"])


def store_to_l3(conn, kv, tokens) -> tuple:
    """Store ``tokens``' blocks from engine pages [0, n) with write-behind to L3; wait for the PUTs."""
    chain = conn.hasher.chain(tokens)
    st = conn.store(chain, l3=True)
    conn.save(st, kv, list(range(st.count)))
    conn.commit(st)
    return chain, wait_l3_idle(conn)


def wait_terminal(conn, req: str, timeout_s: float = 20.0, attempt: int = 0) -> dict:
    """Block (bounded) on the ``wait(terminal=True)`` op until the request's prefetch session is
    terminal (the sidecar answers when it ends: no polling); returns its view."""
    p = conn.wait(req, attempt=attempt, terminal=True, timeout_s=timeout_s)
    assert p["state"] == "terminal", f"session {req} not terminal after {timeout_s} s: {p}"
    # terminal, yet answered by the wait's own deadline: the session ended without waking it
    assert not p.get("timed_out"), f"session {req} ended but its waiter was not woken: {p}"
    return p


def store_get_load_equal(conn, kv, tokens) -> int:
    """Store ``tokens``' blocks from engine pages [0, n), GET them back, load into fresh tensors
    and assert the bytes are identical; returns the leased count."""
    import torch

    chain = conn.hasher.chain(tokens)
    st = conn.store(chain)
    conn.save(st, kv, list(range(st.count)))
    conn.commit(st)
    lease = conn.get(chain)
    out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
    conn.load(lease, out, list(range(lease.count)))
    conn.release(lease)
    assert all(torch.equal(a, b) for la, lb in zip(kv, out) for a, b in zip(la, lb))
    return lease.count
