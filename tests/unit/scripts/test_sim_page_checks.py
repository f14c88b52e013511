"""The real-process simulator's own page checks (``scripts.sim_ranks.PageChecks``): every page a
request restored is checked against the KV the model would have produced, after the arm's timed
loop unless the engine runs short of pages -- with real torch pages, bit for bit."""

from __future__ import annotations

import hashlib

import torch

from scripts import sim_ranks
from scripts.sim_ranks import PageChecks, engine_pages, fill_pages, make_layout


def _keys(n: int, tag: str = "k") -> list:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def _rank_kv(tp: int, pages: int):
    lay = make_layout(tp)
    shape = (pages, lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
    kv = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(lay.kv_factor)) for _ in range(lay.num_layers)]
    return lay, kv, sim_ranks._base(lay, 0)


def test_engine_pages_hold_every_block_of_the_stream_within_the_memory_cap():
    lay = make_layout(2)
    T = lay.tokens_per_block
    stream = [(0.0, f"r{i}", list(range(T * 10 + 5))) for i in range(7)]  # 10 full blocks each
    assert engine_pages(lay, stream) == 70
    assert engine_pages(lay, stream, floor=600) == 600
    page = T * lay.heads_per_shard * lay.head_dim * 2 * lay.kv_factor * lay.num_layers
    huge = [(0.0, "big", list(range(T * (2 * sim_ranks.ENGINE_BYTES_MAX // page))))]
    assert engine_pages(lay, huge) == sim_ranks.ENGINE_BYTES_MAX // page
    assert engine_pages(lay, []) == 1


def test_held_pages_are_checked_only_when_drained_and_a_changed_byte_is_counted():
    lay, kv, base = _rank_kv(2, 16)
    checks = PageChecks(kv, base)
    a, b = [0, 1, 2], [5, 6]
    ka, kb = _keys(3, "a"), _keys(2, "b")
    fill_pages(kv, base, a, ka)
    fill_pages(kv, base, b, kb)
    checks.hold(a, ka)
    checks.hold(b, kb)
    checks.hold([], [])  # (a request that restored nothing holds nothing)
    assert checks.checked == 0 and len(checks.pending) == 2
    kv[3][1][6, 5, 1, 7] += 1  # one element of one page, after it was loaded and before its check
    freed = checks.drain()
    assert sorted(freed) == [0, 1, 2, 5, 6]
    assert checks.corrupt == 1 and checks.checked == 5 and checks.in_run == 0
    assert not checks.pending and checks.drain() == []


def test_an_engine_short_of_pages_checks_the_oldest_in_the_run_and_counts_them():
    lay, kv, base = _rank_kv(4, 16)
    checks = PageChecks(kv, base)
    batches = [([0, 1], _keys(2, "x")), ([2, 3, 4], _keys(3, "y")), ([7], _keys(1, "z"))]
    for pages, keys in batches:
        fill_pages(kv, base, pages, keys)
        checks.hold(pages, keys)
    assert checks.make_room(3) == [0, 1, 2, 3, 4]  # oldest first, whole requests, until 3 are free
    assert checks.in_run == 5 and checks.checked == 5 and len(checks.pending) == 1
    assert checks.make_room(0) == []
    assert checks.drain() == [7]
    assert checks.checked == 6 and checks.in_run == 5 and checks.corrupt == 0
    assert checks.make_room(4) == []  # nothing held: nothing to free
