"""Bounds for the real-process TTFT benchmark, from the rates the run itself achieved, and the
per-request breakdown of each arm's gap to the bound by phase.

* :func:`measured_rates`: the L3 read cost the sidecar achieved (a least-squares fit of
  ``latency + blocks x s_per_block`` over every chunk read of the run, from the sessions' own
  events), the prefill cost per block (without the group's rank skew, a cost per request:
  :func:`prefill_rate`) and the copy cost per block the engine achieved.
* :func:`per_request_bounds`: the stream replayed on one FIFO engine with an LRU pool of the
  sidecar's size (filled by every prefill): per request the serial bound
  ``min_k (queue + transfer(k) + copy(k) + compute(n - k))`` (pool hits cost their copy) and the
  overlap oracle (``max(transfer, compute)``: needs compute/load overlap; report only), with
  the parts of the serial one (queue, transfer, copy, compute).
* :func:`gap_breakdown`: per arm, where the mean TTFT goes beyond the bound: waiting for the
  engine (queue), waiting for the request's own prefetch, the GET, the copy, the prefill.
"""

from __future__ import annotations

import collections
import hashlib
import statistics

from scripts.common import percentile

PHASES = ("enter", "queue", "prefetch", "get", "load", "prefill")


class LruPool:
    """The engine-side pool every bound replays: an LRU of ``capacity`` block keys, filled by
    every prefill (a request's blocks become the most recent, oldest evicted first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: collections.OrderedDict = collections.OrderedDict()

    def hits(self, keys: list) -> int:
        """The leading keys the pool holds (a prefix: the chain stops at the first miss)."""
        h = 0
        while h < len(keys) and keys[h] in self._keys:
            h += 1
        return h

    def fill(self, keys: list) -> None:
        for key in keys:
            self._keys[key] = True
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


def no_prefetch_service_s(prompts: list, tokens_per_block: int, compute_ms_per_ktok: float, pool_blocks: int) -> list:
    """Per prompt, what an engine that never reads L3 spends on it: the prefill of what an LRU
    pool of ``pool_blocks`` blocks (filled by every prefill) does not hold."""
    T = tokens_per_block
    pool = LruPool(pool_blocks)
    out = []
    for toks in prompts:
        keys, h = [], b""
        for j in range(len(toks) // T):
            h = hashlib.blake2b(h + repr(toks[j * T:(j + 1) * T]).encode(), digest_size=16).digest()
            keys.append(h)
        hit = pool.hits(keys)
        out.append((len(toks) - hit * T) * compute_ms_per_ktok / 1024 / 1e3)
        pool.fill(keys)
    return out


def keyed_stream(stream: list, layout) -> list:
    from kvsidecar.connector.hashing import BlockHasher

    h = BlockHasher(layout)
    return [(arr, rid, h.chain(toks)) for arr, rid, toks in stream]


def fit_reads(reads: list) -> tuple | None:
    """(latency_s, s_per_block) by least squares over [(blocks, seconds)]; None without reads.
    Reads of one size cannot split latency from bandwidth: then latency is 0 (all per block)."""
    if not reads:
        return None
    n = len(reads)
    kb = sum(k for k, _ in reads) / n
    sb = sum(s for _, s in reads) / n
    var = sum((k - kb) ** 2 for k, _ in reads) / n
    if var > 1e-9:
        slope = sum((k - kb) * (s - sb) for k, s in reads) / n / var
        lat = sb - slope * kb
        lat = min(max(lat, 0.0), min(s for _, s in reads))
    else:
        lat = 0.0
    per_block = max(1e-9, (sum(s for _, s in reads) - n * lat) / sum(k for k, _ in reads))
    return lat, per_block


def prefill_rate(arms: dict, tokens_per_block: int) -> float | None:
    """The engine's prefill cost per recomputed block over every arm's requests, or None (none
    recomputed a block).  A request's ``prefill_ms`` ends with the group's slowest rank: its
    ``rank_skew_ms`` is a cost per request, not per block, and is left out (the virtual model adds
    the skew per admission; counted in the rate as well, it was paid twice, ~0.1 ms a block at TP 4,
    and at 0.9 load no_prefetch's p50 was over-predicted by 13-20 %)."""
    pre_ms, pre_blocks = 0.0, 0.0
    for a in arms.values():
        for r in a.get("results", ()):
            blocks = r["recomputed_tokens"] / tokens_per_block
            if blocks >= 1:
                pre_ms += r["prefill_ms"] - r.get("rank_skew_ms", 0.0)
                pre_blocks += blocks
    return pre_ms / 1e3 / pre_blocks if pre_blocks else None


def measured_rates(arms: dict, layout, *, nominal_l3_s_per_block: float, nominal_latency_s: float,
                   nominal_compute_s_per_block: float) -> dict:
    """What this run achieved, over every arm (all read the same L3, on the same engine)."""
    T = layout.tokens_per_block
    reads, load_ms, load_blocks = [], 0.0, 0
    for a in arms.values():
        for r in a.get("results", ()):
            for ev in r.get("events") or ():
                if ev[0] == "read":
                    reads.append((ev[2][1], ev[2][2]))
            if r["restored_tokens"]:
                load_ms += r["load_ms"]
                load_blocks += r["restored_tokens"] // T
    fit = fit_reads(reads)
    lat, per_block = fit if fit else (nominal_latency_s, nominal_l3_s_per_block)
    compute = prefill_rate(arms, T) or nominal_compute_s_per_block
    copy = load_ms / 1e3 / load_blocks if load_blocks else 0.0
    return {"l3_latency_s": lat, "l3_s_per_block": per_block, "l3_reads": len(reads), "l3_measured": bool(fit),
            "compute_s_per_block": compute, "copy_s_per_block": copy, "ratio": per_block / compute,
            "nominal": {"l3_latency_s": nominal_latency_s, "l3_s_per_block": nominal_l3_s_per_block,
                        "compute_s_per_block": nominal_compute_s_per_block,
                        "ratio": nominal_l3_s_per_block / nominal_compute_s_per_block}}


def replay_bounds(stream: list, *, latency_s: float, s_per_block_at, compute_s_per_block: float,
                  copy_s_per_block: float, pool_blocks: int, key_bytes: int = 16) -> list:
    """The one replay behind every bound (this benchmark's and the virtual simulator's):
    ``stream`` (``[(arrival_s, rid, chain)]``) on one FIFO engine with an LRU pool of
    ``pool_blocks`` blocks filled by every prefill.  Per request, in stream order, a dict with
    ``serial`` and ``oracle`` (TTFT, seconds) and the serial bound's parts (seconds: ``queue``,
    ``transfer``, ``copy``, ``compute``; ``k`` blocks restored, ``hits`` pool hits, ``blocks``).

    Pool hits cost only their copy; the rest costs, for the best restore length k,
    ``transfer(k) + compute(rest - k) + copy(k)`` (serial) or ``max(transfer(k), compute(rest -
    k) + copy(k))`` (oracle: needs compute/load overlap; report only), with ``transfer(k) =
    latency + k x s_per_block_at(start)`` (``start``: when the engine takes the request up)."""
    c, cp = compute_s_per_block, copy_s_per_block
    rows = [dict() for _ in stream]
    for kind in ("serial", "oracle"):
        pool = LruPool(pool_blocks)
        free_at = 0.0
        for (arrival, _, chain), row in zip(stream, rows):
            keys = [chain[i:i + key_bytes] for i in range(0, len(chain), key_bytes)]
            h = pool.hits(keys)
            rest = len(keys) - h
            start = max(arrival, free_at)
            per_block = s_per_block_at(start)
            best, parts = float("inf"), None
            for k in range(rest + 1):
                transfer = (latency_s + k * per_block) if k else 0.0
                compute = (rest - k) * c + k * cp
                v = transfer + compute if kind == "serial" else max(transfer, compute)
                if v < best:
                    best, parts = v, (k, transfer, compute)
            free_at = start + (h * cp + best)
            row[kind] = free_at - arrival
            if kind == "serial":
                k, transfer, compute = parts
                row.update(queue=start - arrival, transfer=transfer, copy=(h + k) * cp,
                           compute=compute - k * cp, k=k, hits=h, blocks=len(keys))
            pool.fill(keys)
    return rows


def per_request_bounds(keyed: list, rates: dict, pool_blocks: int, key_bytes: int = 16) -> dict:
    """rid -> {serial, oracle, queue, transfer, copy, compute (ms), k, hits, blocks} with this
    run's measured rates (:func:`replay_bounds`)."""
    l3 = rates["l3_s_per_block"]
    rows = replay_bounds(keyed, latency_s=rates["l3_latency_s"], s_per_block_at=lambda start: l3,
                         compute_s_per_block=rates["compute_s_per_block"],
                         copy_s_per_block=rates["copy_s_per_block"], pool_blocks=pool_blocks, key_bytes=key_bytes)
    ms = ("serial", "oracle", "queue", "transfer", "copy", "compute")
    return {rid: {k: (v * 1e3 if k in ms else v) for k, v in row.items()}
            for (_, rid, _), row in zip(keyed, rows)}


_pct = percentile  # (scripts.common)


def summary(ms: list) -> dict:
    return {"ttft_p50_ms": _pct(ms, 0.5), "ttft_p90_ms": _pct(ms, 0.9), "ttft_p99_ms": _pct(ms, 0.99),
            "ttft_mean_ms": sum(ms) / max(1, len(ms))}


def phases_of(r: dict) -> dict | None:
    """A request's measured phases (ms) from its timeline, or None without one."""
    t = r.get("timeline")
    if not t or "admit" not in t:
        return None
    entered = t.get("entered", 0.0)
    terminal = next((ev[1] for ev in r.get("events") or () if ev[0] == "terminal"), None)
    waited = max(0.0, t["admit"] - entered)
    # time until its own session ended counts as prefetch; the rest of the wait was the engine's
    prefetch = min(waited, max(0.0, terminal - entered)) if terminal is not None else 0.0
    return {"enter": entered, "queue": waited - prefetch, "prefetch": prefetch,
            "get": t["got"] - t["admit"], "load": t["loaded"] - t["got"],
            "prefill": t["prefill_end"] - t["loaded"]}


def gap_breakdown(results: list, bounds: dict) -> dict:
    """Mean measured phases, the bound's parts, and the gap per phase (ms), over the arm's
    requests; also the same over pool hits (the bound restores nothing from L3 and computes
    at most the suffix) to expose the fixed cost per request."""
    rows = [(phases_of(r), bounds.get(r["req"]), r) for r in results]
    rows = [(p, b, r) for p, b, r in rows if p is not None and b is not None]
    if not rows:
        return {}

    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0

    meas = {ph: mean([p[ph] for p, _, _ in rows]) for ph in PHASES}
    bnd = {"queue": mean([b["queue"] for _, b, _ in rows]), "prefetch": mean([b["transfer"] for _, b, _ in rows]),
           "load": mean([b["copy"] for _, b, _ in rows]), "prefill": mean([b["compute"] for _, b, _ in rows])}
    gap = {ph: meas[ph] - bnd.get(ph, 0.0) for ph in PHASES}
    hits = [(r, b) for _, b, r in rows if b["hits"] >= b["blocks"] - 2]
    return {"n": len(rows), "measured": meas, "bound": bnd, "gap": gap,
            "ttft_mean_ms": mean([r["ttft_ms"] for _, _, r in rows]),
            "bound_mean_ms": mean([b["serial"] for _, b, _ in rows]),
            "ratio_to_bound_p50": _pct([r["ttft_ms"] / max(1e-3, b["serial"]) for _, b, r in rows], 0.5),
            "pool_hits": {"n": len(hits), "ttft_mean_ms": mean([r["ttft_ms"] for r, _ in hits]),
                          "bound_mean_ms": mean([b["serial"] for _, b in hits])}}


def print_gaps(arms: dict, control_ms: dict | None = None) -> None:
    """The gap table; ``control_ms``: arm -> the sidecar control thread's ms per request to show
    (default: each arm's own ``sidecar_busy``)."""
    print(f"\ngap to the serial bound by phase (mean ms per request; + is lost to the bound; ctl: the "
          f"sidecar control thread's ms per request):")
    print(f"{'arm':<18} {'TTFT':>7} {'bound':>7} " + " ".join(f"{ph:>9}" for ph in PHASES)
          + f" {'ctl':>6}   pool hits: TTFT/bound")
    for arm, a in arms.items():
        g = a.get("gap") or {}
        if not g:
            continue
        ph = g["pool_hits"]
        hit = f"{ph['ttft_mean_ms']:.1f}/{ph['bound_mean_ms']:.1f} ms (n={ph['n']})" if ph["n"] else "-"
        ctl = (control_ms or {}).get(arm, (a.get("sidecar_busy") or {}).get("ms_per_request"))
        print(f"{arm:<18} {g['ttft_mean_ms']:>7.1f} {g['bound_mean_ms']:>7.1f} "
              + " ".join(f"{g['gap'][p]:>+9.1f}" for p in PHASES)
              + (f" {ctl:>6.2f}" if ctl is not None else f" {'-':>6}") + f"   {hit}")
