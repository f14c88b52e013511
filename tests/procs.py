"""Entry points for helper processes started with the ``spawn`` method.

They live in an importable module (not in test files) so spawn children can
find them; each reports through a pipe and never waits without a deadline.
"""

from __future__ import annotations

import hashlib
import os

from connector.client import SidecarClient


def echo_worker(instance: str, rank: int, n: int, conn) -> None:
    """Send ``n`` pings with random payloads; report (ok, mismatches, digest)."""
    c = SidecarClient(instance, group="echo", rank=rank, group_size=64)
    c.attach()
    h = hashlib.sha256()
    bad = 0
    for i in range(n):
        payload = os.urandom(1 + (i * 37 + rank) % 3000)
        reply = c.call("ping", payload=payload)
        if reply["payload"] != payload:
            bad += 1
        h.update(reply["payload"])
    c.detach()
    conn.send((n, bad, h.hexdigest()))


def attach_and_block(instance: str, conn) -> None:
    """Attach, report the slot, then keep pinging until killed."""
    c = SidecarClient(instance, group="victim")
    c.attach()
    conn.send(c.slot)
    while True:
        c.call("ping", payload=b"x" * 100)


def attach_and_wait(instance: str, conn) -> None:
    c = SidecarClient(instance, group="idle")
    c.attach()
    conn.send(c.slot)
    conn.recv()
    c.detach()
    conn.send("detached")
