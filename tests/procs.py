"""Entry points for helper processes started with the ``spawn`` method.

They live in an importable module (not in test files) so spawn children can
find them; each reports through a pipe and never waits without a deadline.
"""

from __future__ import annotations

import hashlib
import os

from kvsidecar.connector.client import SidecarClient


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


# -- multi-rank KV workers ---------------------------------------------------------------------

def make_kv(layout_dict: dict, rank: int, num_pages: int, seed: int):
    """Engine KV tensors for one rank, filled with a pattern that depends on (seed, rank)."""
    import torch

    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(**layout_dict)
    g = torch.Generator().manual_seed(seed * 1000 + lay.shard_of(rank))
    shape = (num_pages, lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
    return [tuple(torch.randint(-1000, 1000, shape, generator=g).to(torch.float16) for _ in range(lay.kv_factor))
            for _ in range(lay.num_layers)]


def pages_digest(kv, pages) -> str:
    h = hashlib.sha256()
    for layer in kv:
        for t in layer:
            for p in pages:
                h.update(t[p].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def kv_rank_worker(instance: str, layout_dict: dict, rank: int, group: str, conn, namespace: str = "") -> None:
    """A TP rank driven by commands over a pipe; replies (ok, result)."""
    import torch

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.errors import KvSidecarError
    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(**layout_dict)
    kc = KVConnector(instance, lay, rank=rank, group=group, namespace=namespace, verify_loads="all")
    kv = None
    leases = {}
    staged = {}  # staging id -> Staging (its commit checksums the blocks)
    while True:
        if not conn.poll(60):
            return
        cmd, args = conn.recv()
        try:
            if cmd == "attach":
                kc.attach()
                res = kc.client.slot
            elif cmd == "fill":  # engine tensors with a known pattern
                kv = make_kv(layout_dict, rank, args["pages"], args["seed"])
                res = pages_digest(kv, range(args["pages"]))
            elif cmd == "chain":
                res = kc.hasher.chain(args["tokens"])
            elif cmd == "store":  # store pages [0, n) of the engine pool under the chain of tokens
                chain = kc.hasher.chain(args["tokens"])
                st = kc.store(chain, req=args.get("req"), step=args.get("step"))
                pages = list(range(st.start, st.start + st.count))
                kc.save(st, kv, pages)
                staged[st.id] = st
                if args.get("commit", True):
                    r = kc.commit(staged.pop(st.id), ok=args.get("ok", True))
                    res = {"staging": st.id, "start": st.start, "count": st.count, "published": r["published"]}
                else:
                    res = {"staging": st.id, "start": st.start, "count": st.count}
            elif cmd == "commit":
                res = kc.commit(staged.pop(args["staging"]), ok=args.get("ok", True))["published"]
            elif cmd == "lookup":
                res = kc.lookup(kc.hasher.chain(args["tokens"]), req=args.get("req"), step=args.get("step"))
            elif cmd == "get_load":  # get + load into fresh tensors, digest of the loaded pages
                chain = kc.hasher.chain(args["tokens"])
                lease = kc.get(chain, max_blocks=args.get("max_blocks"), req=args.get("req"), step=args.get("step"))
                fresh = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
                pages = list(range(lease.count))
                kc.load(lease, fresh, pages)
                leases[lease.id] = lease
                res = {"lease": lease.id, "count": lease.count, "digest": pages_digest(fresh, pages),
                       "blocks": list(lease.blocks)}
                if args.get("release", True):
                    kc.release(lease)
            elif cmd == "release":
                res = kc.release(args["lease"])
            elif cmd == "digest":
                res = pages_digest(kv, args["pages"])
            elif cmd == "stats":
                res = kc.stats(check=True)
            elif cmd == "detach":
                kc.detach()
                conn.send((True, None))
                return
            else:
                raise ValueError(cmd)
            conn.send((True, res))
        except KvSidecarError as exc:
            conn.send((False, (type(exc).__name__, getattr(exc, "code", None), str(exc))))


def page_pattern(tokens, rank_shard: int, layer: int, kv: int, shape):
    """KV content of one page as a pure function of its tokens (so any writer agrees)."""
    import torch

    seed = (hash(tuple(tokens)) ^ (rank_shard * 1_000_003 + layer * 101 + kv)) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-500, 500, shape, generator=g).to(torch.float16)


def chain_kv(layout_dict: dict, rank: int, tokens):
    """One rank's engine KV for a chain, page ``p`` holding ``page_pattern`` of the tokens up to
    and including block ``p``: two chains never share a page's bytes, so a rank handed another
    chain's blocks copies visibly wrong KV."""
    import torch

    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(**layout_dict)
    tpb, n = lay.tokens_per_block, len(tokens) // lay.tokens_per_block
    shape = (lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
    shard = lay.shard_of(rank)
    return [tuple(torch.stack([page_pattern(tokens[:(p + 1) * tpb], shard, layer, k, shape) for p in range(n)])
                  for k in range(lay.kv_factor)) for layer in range(lay.num_layers)]


def kv_stress_worker(instance: str, layout_dict: dict, rank: int, group: str, seed: int, steps: int,
                     skew_s: float, conn) -> None:
    """Run ``steps`` of store / get+load+verify / release with a shared system prompt.

    Every rank of a group runs the same (seeded) request sequence at its own pace; it
    reports the decisions it saw (so the test can compare ranks) and any data mismatch.
    """
    import random
    import time

    import torch

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.errors import ErrorCode, RemoteError
    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(**layout_dict)
    T = lay.tokens_per_block
    shard = lay.shard_of(rank)
    kc = KVConnector(instance, lay, rank=rank, group=group)
    kc.attach()
    conn.send("attached")
    if not conn.poll(60) or conn.recv() != "go":  # every rank starts together; skew is the jitter below
        return
    rng = random.Random(seed)  # the request stream: identical on every rank of the group
    skew_rng = random.Random(seed * 7 + rank)  # per-rank timing only
    shape = (lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
    n_pages = 16
    kv = [tuple(torch.zeros((n_pages,) + shape, dtype=torch.float16) for _ in range(lay.kv_factor))
          for _ in range(lay.num_layers)]
    system = list(range(2 * T))
    decisions, bad, limited = [], 0, 0
    for step in range(steps):
        tokens = system + [rng.randrange(1000, 50000) for _ in range(rng.randrange(1, 10) * T)]
        tokens = tokens[: n_pages * T]
        chain = kc.hasher.chain(tokens)
        npg = len(chain) // 16
        for p in range(npg):
            for layer in range(lay.num_layers):
                for k in range(lay.kv_factor):
                    kv[layer][k][p] = page_pattern(tokens[p * T:(p + 1) * T], shard, layer, k, shape)
        try:
            st = kc.store(chain, req=f"s{step}", step=2 * step)
        except RemoteError as exc:  # a full pool is a group decision too: both ranks see it
            assert exc.code == ErrorCode.LIMIT, exc
            decisions.append(("limit", step))
            limited += 1
            continue
        kc.save(st, kv, list(range(st.start, st.start + st.count)))
        kc.commit(st)
        if skew_s:
            # the behaviour under test, not synchronisation: rank 1 arrives late by a random skew
            time.sleep(skew_rng.random() * skew_s if rank else 0)
        lease = kc.get(chain, req=f"s{step}", step=2 * step + 1)
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        kc.load(lease, out, list(range(lease.count)))
        for p in range(lease.count):
            for layer in range(lay.num_layers):
                for k in range(lay.kv_factor):
                    want = page_pattern(tokens[p * T:(p + 1) * T], shard, layer, k, shape)
                    bad += not torch.equal(out[layer][k][p], want)
        kc.release(lease)
        decisions.append((st.id, st.start, st.count, lease.id, lease.count))
    kc.detach()
    conn.send((decisions, bad, limited))


def prefetch_and_block(instance: str, layout_dict: dict, chain: bytes, conn) -> None:
    """Start a prefetch, report, then wait to be killed."""
    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.layout import KVLayout

    kc = KVConnector(instance, KVLayout(**layout_dict), group="doomed")
    kc.attach()
    kc.prefetch(chain, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
    conn.send("started")
    conn.poll(60)


def prefetch_cost_aware_and_block(instance: str, layout_dict: dict, chain: bytes, conn) -> None:
    """Start a cost_aware prefetch for a scheduling candidate (ETA now, prefill 10 ms a block),
    report, then wait to be killed."""
    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.layout import KVLayout

    kc = KVConnector(instance, KVLayout(**layout_dict), group="doomed")
    kc.attach()
    kc.prefetch(chain, "r", policy="cost_aware", eta_s=0.0, prefill_s_per_block=0.01, chunk_max_blocks=8)
    conn.send("started")
    conn.poll(60)


def kv_attach_and_wait(instance: str, layout_dict: dict, rank: int, group: str, conn) -> None:
    """Attach a KV rank, report, then wait for the parent's word (or be killed)."""
    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.layout import KVLayout

    c = KVConnector(instance, KVLayout(**layout_dict), rank=rank, group=group)
    c.attach()
    conn.send(c.client.slot)
    if conn.poll(60):
        conn.recv()
    c.detach()
