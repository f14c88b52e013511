"""A TP rank process for the chaos tests: driven by commands over a pipe, it announces the
phase it is entering (``("phase", name)``) so the parent can kill it at that exact point, and
checks every page it loads against the pattern it stored (a corrupt page is counted, not
hidden)."""

from __future__ import annotations

import time


def chaos_rank(instance: str, layout_dict: dict, rank: int, group: str, pages: int, seed: int, conn) -> None:
    import torch

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.errors import CorruptBlock, KvSidecarError
    from kvsidecar.shm.layout import KVLayout

    from ..procs import chain_kv

    lay = KVLayout(**layout_dict)
    kc = KVConnector(instance, lay, rank=rank, group=group, timeout_s=5.0)
    def kv_of(tokens):  # a pure function of the chain: every writer agrees, two chains never do
        return chain_kv(layout_dict, rank, tokens)

    def phase(name: str, args: dict) -> None:
        """Announce ``name``; with ``hold`` wait there for the parent's "go" (or its kill -9)."""
        conn.send(("phase", name))
        if args.get("hold"):
            if not conn.poll(60) or conn.recv() != "go":
                raise SystemExit(1)
    while True:
        if not conn.poll(120):
            return
        cmd, args = conn.recv()
        try:
            if cmd == "attach":
                kc.attach()
                res = kc.client.generation
            elif cmd == "store":
                chain = kc.hasher.chain(args["tokens"])
                st = kc.store(chain, req=args["req"], step=args["step"], l3=args.get("l3", False))
                phase("saving", args)
                kc.save(st, kv_of(args["tokens"]), list(range(st.start, st.start + st.count)))
                r = kc.commit(st)
                res = {"count": st.count, "published": r.get("published")}
            elif cmd == "get_load":
                chain = kc.hasher.chain(args["tokens"])
                lease = kc.get(chain, req=args["req"], step=args["step"])
                kv = kv_of(args["tokens"])
                out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
                phase("loading", args)
                try:
                    kc.load(lease, out, list(range(lease.count)))  # verifies every block first
                    refused = 0
                except CorruptBlock:
                    refused = 1  # caught, not loaded: counted apart from pages that slipped through
                n = lease.count
                corrupt = sum(int(not torch.equal(a[p], b[p])) for la, lb in zip(kv, out) for a, b in zip(la, lb)
                              for p in range(n)) if not refused else 0
                kc.release(lease)
                res = {"count": n, "corrupt_pages": corrupt, "refused": refused, "stale": lease.stale}
            elif cmd == "prefetch":
                chain = kc.hasher.chain(args["tokens"])
                kc.prefetch(chain, args["req"], policy=args.get("policy", "timeout"), budget_s=args.get("budget_s"),
                            chunk_max_blocks=args.get("chunk"))
                conn.send(("phase", "prefetching"))
                res = True
            elif cmd == "poll_terminal":
                # the sidecar answers when the session ends (or at the bound): no polling
                res = kc.wait(args["req"], terminal=True, timeout_s=args.get("timeout_s", 20.0))
            elif cmd == "lookup_timed":  # a call whose failure time is measured (dead sidecar)
                chain = kc.hasher.chain(args["tokens"])
                t0 = time.monotonic()
                try:
                    kc.lookup(chain)
                    res = {"error": None, "ms": (time.monotonic() - t0) * 1e3}
                except KvSidecarError as exc:
                    res = {"error": type(exc).__name__, "ms": (time.monotonic() - t0) * 1e3}
            elif cmd == "detach":
                kc.detach()
                conn.send(("done", None))
                return
            else:
                raise ValueError(cmd)
            conn.send(("done", res))
        except KvSidecarError as exc:
            conn.send(("error", (type(exc).__name__, getattr(exc, "code", None), str(exc))))
