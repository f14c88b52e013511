"""Metrics benchmark: what Prometheus exposition costs the control loop.

Two sidecars in the same run, identical but for ``metrics.enabled`` (the "on" one scraped over
HTTP every ``KVSBENCH_SCRAPE_S`` seconds, default 0.1 s — 150 times a usual 15 s Prometheus interval,
so scrapes overlap every trial — throughout, by a scraper thread), and
interleaved repeated trials (the arm order alternates each trial):

* ring RTT: ``ping`` round trips through the rings (median of each trial);
* ``get`` + ``release`` of a 512-block resident chain through the rings (median of each trial).

Reported: the median over trials of each trial's median, the spread (min..max of the trial
medians), on / off of those, and the median of the paired per-trial ratios (each trial measures
both arms back to back, so a burst of load from other processes on a shared machine hits the
pair rather than one arm).  Target: within 5 %.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import urllib.request

import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=16, tp_size=1)
BLOCKS = 512


def _median_us(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


class _Scraper(threading.Thread):
    def __init__(self, port: int, every_s: float):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.every_s = every_s
        self.stop_event = threading.Event()
        self.latencies: list = []
        self.bytes = 0

    def run(self):
        while not self.stop_event.wait(self.every_s):
            t0 = time.perf_counter()
            body = urllib.request.urlopen(self.url, timeout=10).read()
            self.latencies.append(time.perf_counter() - t0)
            self.bytes = len(body)


def run(quick: bool = False) -> dict:
    trials = int(os.environ.get("KVSBENCH_TRIALS", 5 if quick else 9))
    n_ping = 1000 if quick else 3000
    n_get = 200 if quick else 600
    every_s = float(os.environ.get("KVSBENCH_SCRAPE_S", 0.1))
    over = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    over["pool.num_blocks"] = BLOCKS * 2
    arms = {}
    procs = []
    scraper = None
    try:
        for arm, extra in (("off", {}), ("on", {"metrics.enabled": True, "metrics.port": 0})):
            inst = f"kvsbenchmet{arm}{os.getpid()}"
            procs.append(SidecarProcess(inst, overrides=dict(over, **extra)))
            c = KVConnector(inst, LAY)
            c.attach()
            chain = c.hasher.chain(list(range(BLOCKS * LAY.tokens_per_block)))
            kv = [tuple(torch.zeros(BLOCKS, LAY.tokens_per_block, 1, 8, dtype=torch.bfloat16) for _ in range(2))]
            st = c.store(chain)
            c.save(st, kv, list(range(st.count)))
            c.commit(st)
            arms[arm] = {"conn": c, "chain": chain, "rtt": [], "get": []}
            if arm == "on":
                port = c.stats()["metrics"]["port"]
                scraper = _Scraper(port, every_s)
                scraper.start()
        for a in arms.values():  # warm both
            _median_us(lambda: a["conn"].client.call("ping"), 500)
        for t in range(trials):
            for arm in (("off", "on") if t % 2 == 0 else ("on", "off")):
                a = arms[arm]
                c, chain = a["conn"], a["chain"]
                a["rtt"].append(_median_us(lambda: c.client.call("ping"), n_ping))

                def get_release():
                    lease = c.get(chain)
                    assert lease.count == BLOCKS
                    c.release(lease)

                a["get"].append(_median_us(get_release, n_get))
        res = {"quick": quick, "trials": trials, "scrape_every_s": every_s, "blocks": BLOCKS}
        for arm, a in arms.items():
            for key in ("rtt", "get"):
                xs = a[key]
                res[f"{key}_{arm}_us"] = statistics.median(xs)
                res[f"{key}_{arm}_spread_us"] = [min(xs), max(xs)]
                res[f"{key}_{arm}_trials_us"] = xs
            assert a["conn"].stats(check=True)["invariants"] == ""
        for key in ("rtt", "get"):
            res[f"{key}_on_vs_off"] = res[f"{key}_on_us"] / res[f"{key}_off_us"]
            res[f"{key}_paired_ratio_median"] = statistics.median(
                on / off for on, off in zip(arms["on"][key], arms["off"][key]))
        scraper.stop_event.set()
        scraper.join(10)
        res["scrapes"] = len(scraper.latencies)
        if not res["scrapes"]:
            raise RuntimeError("the 'on' sidecar was never scraped during the trials: the figure would not measure it")
        res["scrape_ms_p50"] = statistics.median(scraper.latencies) * 1e3 if scraper.latencies else None
        res["scrape_bytes"] = scraper.bytes
        return res
    finally:
        if scraper is not None:
            scraper.stop_event.set()
        for a in arms.values():
            a["conn"].detach()
        for p in procs:
            p.stop()


def table(r: dict):
    def spread(key):
        lo, hi = r[key]
        return f"{lo:.1f}..{hi:.1f}"

    return [
        ("rtt_off_us", r["rtt_off_us"], f"ping RTT, metrics off; median of {r['trials']} trial medians "
                                        f"(spread {spread('rtt_off_spread_us')})"),
        ("rtt_on_us", r["rtt_on_us"], f"metrics on, scraped every {r['scrape_every_s']:g} s "
                                      f"(spread {spread('rtt_on_spread_us')})"),
        ("rtt_on_vs_off", r["rtt_on_vs_off"], "target <= 1.05"),
        ("rtt_paired_ratio", r["rtt_paired_ratio_median"], "median of per-trial on/off (robust to load bursts)"),
        ("get_release_off_us", r["get_off_us"], f"get + release of {r['blocks']} blocks through the rings, off "
                                                 f"(spread {spread('get_off_spread_us')})"),
        ("get_release_on_us", r["get_on_us"], f"metrics on (spread {spread('get_on_spread_us')})"),
        ("get_release_on_vs_off", r["get_on_vs_off"], "target <= 1.05"),
        ("get_release_paired_ratio", r["get_paired_ratio_median"], "median of per-trial on/off"),
        ("scrape_ms_p50", r["scrape_ms_p50"], f"one /metrics scrape ({r['scrape_bytes']} B), {r['scrapes']} scrapes"),
    ]
