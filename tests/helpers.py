"""Small test helpers shared by several test files (not fixtures)."""

from __future__ import annotations

import time


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.005):
    """Re-check ``pred()`` until it is truthy (returns its value) or ``timeout_s`` passed (raises
    AssertionError naming ``what``).  For conditions only observable from outside (a reaper, a
    process exit); a wait the product can signal should use that signal instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


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
    """Wait (bounded) until the sidecar has no L3 PUT in flight; returns the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = conn.stats()
        if not s["l3"]["puts_in_flight"] or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


def store_to_l3(conn, kv, tokens) -> tuple:
    """Store ``tokens``' blocks from engine pages [0, n) with write-behind to L3; wait for the PUTs."""
    chain = conn.hasher.chain(tokens)
    st = conn.store(chain, l3=True)
    conn.save(st, kv, list(range(st.count)))
    conn.commit(st)
    return chain, wait_l3_idle(conn)


def wait_terminal(conn, req: str, timeout_s: float = 20.0) -> dict:
    """Poll (bounded) until the request's prefetch session is terminal; returns its view."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = conn.poll(req)
        if p["state"] == "terminal":
            return p
        time.sleep(0.005)
    raise AssertionError(f"session {req} not terminal: {p}")


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
