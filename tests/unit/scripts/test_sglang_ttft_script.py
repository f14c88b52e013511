"""Smoke test of scripts.sglang_ttft's pure parts (the benchmark itself needs genuine SGLang and
minutes: ``.sglang-venv/bin/python -m scripts.sglang_ttft --quick --json FILE``)."""

import pytest

import scripts.sglang_ttft as st
from scripts.sglang_ttft import (ARMS, make_workload, paired, paired_phases, percentile, pooled, print_table, rows,
                                 summarize, verdicts)


def test_workload_shares_prefixes_and_arrives_in_order():
    wl = make_workload(7, requests=32, prefixes=4, prefix_tokens=64, suffix_tokens=16, mean_gap_s=0.1,
                       probes=2, probe_tokens=32)
    assert len(wl.requests) == 32 and len(wl.prefixes) == 4 and len(wl.probes) == 2
    ats = [r.at_s for r in wl.requests]
    assert ats == sorted(ats) and ats[0] == 0.0 and ats[-1] > 0
    for r in wl.requests:
        assert r.ids[:64] == wl.prefixes[r.prefix] and len(r.ids) == 80
    assert len({r.ids[64:] for r in wl.requests}) == 32  # every suffix its own
    assert len({r.prefix for r in wl.requests}) > 1
    assert make_workload(7, requests=32, prefixes=4, prefix_tokens=64, suffix_tokens=16, mean_gap_s=0.1,
                         probes=2, probe_tokens=32) == wl  # deterministic per seed


def test_percentile_interpolates():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert percentile([5], 90) == 5
    with pytest.raises(ValueError):
        percentile([], 50)


def _trial(scale):
    def arm(p50):
        return {**summarize([p50 / 1e3] * 9 + [2 * p50 / 1e3], [0] * 10, True), "probe": {}}
    out = {"no_prefetch": arm(100 * scale), "sglang_file": arm(90 * scale)}
    for mbps in (2000, 80):
        out[f"whole_task@{mbps}"] = arm(80 * scale)
        out[f"timeout@{mbps}"] = arm(85 * scale)
        out[f"cost_aware@{mbps}"] = arm((83 if mbps == 2000 else 120) * scale)
    return out


def test_rows_aggregate_trials_and_judge_cost_aware():
    doc = rows([_trial(1.0), _trial(1.1), _trial(0.9)], [2000, 80])
    assert [r["l3"]["bandwidth_mbps"] for r in doc] == [2000, 80]
    fast, slow = doc
    assert set(fast["arms"]) == set(ARMS) - {"cost_aware_twin", "cost_aware_write_all", "cost_aware_held_off"}  # (only when they ran)
    assert fast["arms"]["no_prefetch"]["ttft_p50_ms"] == pytest.approx(100.0)
    assert fast["arms"]["cost_aware"]["trials"]["ttft_p50_ms"]["min"] == pytest.approx(83 * 0.9)
    assert fast["arms"]["whole_task"]["ttft_p90_ms"] == pytest.approx(percentile([80] * 9 + [160], 90))
    v = verdicts(fast)
    assert v["ttft_p50_ms"]["met"] and v["ttft_p90_ms"]["met"]
    v = verdicts(slow)
    assert not v["ttft_p50_ms"]["met"] and v["ttft_p50_ms"]["bound"] == pytest.approx(84.0)


def test_the_write_behind_a_stream_made_is_aggregated_and_printed(capsys):
    """``stream_l3_blocks`` (kvsidecar arms): the blocks written behind to L3 and gated during the
    stream, median [min..max] over trials, beside the arm's figures; absent for the others."""
    trials = [_trial(1.0), _trial(1.1), _trial(0.9)]
    for t, (w, g) in zip(trials, ((0, 1280), (0, 1104), (16, 1200))):
        t["cost_aware@80"]["stream_l3_blocks"] = {"written": w, "gated": g}
        t["cost_aware_write_all@80"] = {**t["cost_aware@80"], "stream_l3_blocks": {"written": 1250 + w, "gated": 0}}
    slow = rows(trials, [80])[0]
    assert slow["arms"]["cost_aware"]["trials"]["stream_l3_blocks"]["gated"]["median"] == 1200
    assert slow["arms"]["cost_aware_write_all"]["trials"]["stream_l3_blocks"]["written"]["max"] == 1266
    assert "stream_l3_blocks" not in slow["arms"]["no_prefetch"]["trials"]
    print_table({"rows": [slow], "probe": {}})
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("cost_aware "))
    assert "L3 blocks written 0 [0..16] gated 1200 [1104..1280]" in line
    assert "L3 blocks" not in next(x for x in out.splitlines() if x.strip().startswith("no_prefetch"))


def test_the_twin_arm_is_reported_beside_cost_aware_and_judges_nothing():
    """``cost_aware_twin`` (the A/A check): cost_aware again, its own row and paired phases; the
    verdict stays cost_aware's, whatever the twin measured."""
    trials = [_trial(1.0), _trial(1.1)]
    for t, scale in zip(trials, (1.0, 1.1)):
        t["cost_aware_twin@2000"] = {**summarize([500 * scale / 1e3] * 10, [0] * 10, True), "probe": {}}
        t["no_prefetch"]["server_s"] = [{"entry": 0.002, "queue": 0.001, "prefill": 0.05, "rest": 0.001}] * 10
        t["cost_aware_twin@2000"]["server_s"] = [{"entry": 0.002, "queue": 0.001, "prefill": 0.06, "rest": 0.001}] * 10
    fast = rows(trials, [2000])[0]
    assert set(fast["arms"]) == set(ARMS) - {"cost_aware_write_all", "cost_aware_held_off"}
    assert fast["arms"]["cost_aware_twin"]["ttft_p50_ms"] == pytest.approx(500 * 1.05)
    assert verdicts(fast)["ttft_p50_ms"]["cost_aware"] == fast["arms"]["cost_aware"]["ttft_p50_ms"]
    assert verdicts(fast)["ttft_p50_ms"]["met"]
    assert set(paired_phases(trials, 2000)) == {"cost_aware_twin"}  # (cost_aware has no stats here)
    assert paired_phases(trials, 2000)["cost_aware_twin"]["prefill"]["median"] == pytest.approx(10.0)


def test_paired_ratios_compare_arms_within_each_trial():
    """A slow trial (every arm 3x) moves the ratio of medians; the paired ratio does not."""
    trials = [_trial(1.0), _trial(3.0), _trial(1.0)]
    p = paired(trials, 80)
    assert p["ttft_p50_ms"] == {"median": pytest.approx(1.5), "min": pytest.approx(1.5), "max": pytest.approx(1.5), "n": 3}
    assert paired(trials, 2000)["ttft_p90_ms"]["median"] == pytest.approx(83 / 80, abs=1e-3)
    assert paired([{"no_prefetch": trials[0]["no_prefetch"]}], 80) == {}


def test_timeline_breakdown_splits_ttft_into_phases():
    from scripts.sglang_timeline import breakdown, parse_log

    def line(rank, rid, phase, t0, t1):
        return ('[2026 TP0] kvsidecar-timeline {"rank": %d, "rid": "%s", "phase": "%s", "t0": %s, "t1": %s}'
                % (rank, rid, phase, t0, t1))

    lines = [line(0, "r", "prefetch", 10.010, 10.012), line(0, "r", "query_wait", 10.012, 10.015),
             line(0, "r", "storage_hit_query", 10.010, 10.020), line(1, "r", "storage_hit_query", 10.0, 11.0),
             line(0, "r", "get_wait", 10.030, 10.031), line(0, "r", "copy", 10.032, 10.040),
             line(0, "r", "page_transfer", 10.030, 10.045), "unrelated line", "kvsidecar-timeline {bad json"]
    phases = parse_log(lines, rank=0)
    assert set(phases) == {"r"} and phases["r"]["storage_hit_query"] == [(10.010, 10.020)]
    b = breakdown(10.0, 0.1, phases["r"])
    assert b == {"ttft": 100.0, "to_query": pytest.approx(10.0), "query": pytest.approx(10.0),
                 "to_transfer": pytest.approx(10.0), "transfer": pytest.approx(15.0), "after": pytest.approx(55.0),
                 "prefetch": pytest.approx(2.0), "query_wait": pytest.approx(3.0), "get_wait": pytest.approx(1.0),
                 "get": 0.0, "verify": 0.0, "copy": pytest.approx(8.0), "release": 0.0, "demand": 0.0,
                 "check_progress": 0.0, "end": 0.0, "settle_query": 0.0, "settle_copy": 0.0, "checks": 0}
    assert breakdown(10.0, 0.1, {}) is None


def test_pool_hit_verdict_pools_every_kvsidecar_arm_against_file_and_recompute():
    from scripts.sglang_ttft import pool_hit_verdict

    def probe(hits):
        return {"probe": {"hit_ms": hits}}
    trials = [{"no_prefetch": probe([200.0, 220.0]), "sglang_file": probe([150.0, 160.0]),
               "timeout@2": probe([120.0, 140.0]), "cost_aware@2000": probe([130.0, 170.0]), "server_logs": []},
              {"no_prefetch": probe([210.0]), "sglang_file": probe([155.0]), "whole_task@2": probe([125.0])}]
    v = pool_hit_verdict(trials)
    assert v["kvsidecar_pool_hit"]["n"] == 5 and v["kvsidecar_pool_hit"]["median_ms"] == 130.0
    assert v["sglang_file_hit"]["median_ms"] == 155.0 and v["recompute"]["median_ms"] == 210.0
    assert v["verdict"] == {"beats_sglang_file_hit": True, "beats_recompute": True}
    trials[0]["timeout@2"] = probe([400.0, 500.0, 600.0])
    assert pool_hit_verdict(trials)["verdict"]["beats_sglang_file_hit"] is False


def test_a_server_that_could_not_bind_its_port_is_recognised(tmp_path):
    """SGLang does not exit when uvicorn cannot bind: the harness reads it from the log."""
    from scripts.sglang_server import _bind_failed

    log = tmp_path / "server.log"
    log.write_text("[2026-12-05 12:41:15] INFO:     Application startup complete.\n"
                   "[2026-12-05 12:41:15] ERROR:    [Errno 98] error while attempting to bind on address "
                   "('127.0.0.1', 36555): address already in use\n")
    assert _bind_failed(log, 36555)
    assert not _bind_failed(log, 36556)  # another port's failure is not this server's
    assert not _bind_failed(tmp_path / "missing.log", 36555)
    log.write_text("[2026-12-05 12:41:15] INFO:     Application startup complete.\n")
    assert not _bind_failed(log, 36555)


def test_pooled_ratio_takes_every_request_and_bootstraps_over_trials():
    """The figure over every request, not a median of per-trial figures; the interval resamples
    whole trials (the same ones for every arm) and is reproducible."""
    from scripts.trials import pooled_ratio

    med = lambda xs: percentile(xs, 50)  # noqa: E731
    arms = {"a": [[10, 10, 30], [10, 30, 30]], "b": [[20, 20, 20], [20, 20, 20]], "c": [[40] * 3, [40] * 3]}
    r = pooled_ratio(arms, "a", ("b", "c"), med, reps=500)
    # pooled a = [10, 10, 10, 30, 30, 30]: p50 20; per-trial p50s 10 and 30 (their median 20 too)
    assert r["a"] == pytest.approx(20.0) and r["best"] == pytest.approx(20.0) and r["ratio"] == pytest.approx(1.0)
    assert r["n_trials"] == 2 and r["n"] == 6
    lo, hi = r["ci"]
    assert lo == pytest.approx(0.5) and hi == pytest.approx(1.5)  # both trials drawn twice: 10/20 and 30/20
    assert pooled_ratio(arms, "a", ("b", "c"), med, reps=500) == r  # seeded
    assert pooled_ratio(arms, "a", ("missing",), med) is None
    assert pooled_ratio({"a": arms["a"], "b": arms["b"][:1]}, "a", ("b",), med) is None  # trials must pair


def test_pooled_verdict_is_beside_the_median_over_trials():
    trials = [_trial(1.0), _trial(1.1), _trial(0.9)]
    p = pooled(trials, 2000, reps=200)
    # cost_aware 83 x scale against whole_task 80 x scale, in every trial: 83/80 pooled
    assert p["ttft_p50_ms"]["ratio"] == pytest.approx(83 / 80, abs=2e-3)
    assert p["ttft_p50_ms"]["met"] and p["ttft_p50_ms"]["requests"] == 30 and p["ttft_p50_ms"]["n_trials"] == 3
    lo, hi = p["ttft_p50_ms"]["ci90"]
    assert lo <= p["ttft_p50_ms"]["ratio"] <= hi
    slow = pooled(trials, 80, reps=200)["ttft_p50_ms"]
    assert slow["ratio"] == pytest.approx(120 / 80, abs=2e-3) and not slow["met"] and not slow["met_ci"]
    doc = rows(trials, [2000])
    assert doc[0]["arms"]["whole_task"]["pooled"]["requests"] == 30
    assert pooled([{"no_prefetch": trials[0]["no_prefetch"]}], 80) == {}


def test_sglangs_own_time_stats_and_cpu_are_summarised_per_arm():
    trials = [_trial(1.0), _trial(1.0), _trial(1.0)]
    for k, t in enumerate(trials):
        t["no_prefetch"]["server_s"] = [{"entry": 0.002, "queue": 0.010 * (k + 1), "prefill": 0.080, "rest": 0.001}] * 10
        t["no_prefetch"]["cpu_s"] = {"server": 6.0 + k}
    doc = rows(trials, [2000])
    arm = doc[0]["arms"]["no_prefetch"]
    assert arm["server_ms"] == {"entry": 2.0, "queue": 20.0, "prefill": 80.0, "rest": 1.0}  # over every request
    assert arm["trials"]["cpu_s"]["server"]["median"] == 7.0
    assert "server_ms" not in doc[0]["arms"]["whole_task"]  # (no stats: not made up)


def test_paired_phases_subtract_the_same_request_of_no_prefetch_in_the_same_trial():
    """Per kvsidecar arm at one L3 speed: each request's TTFT and SGLang phases minus the same
    request's in no_prefetch of its own trial; a slow trial (every arm 3x) does not leak into a
    delta of another trial's requests."""
    def stats(prefill_s):
        return [{"entry": 0.002, "queue": 0.001, "prefill": prefill_s, "rest": 0.001}] * 10
    trials = [_trial(1.0), _trial(3.0)]
    for t, scale in zip(trials, (1.0, 3.0)):
        t["no_prefetch"]["server_s"] = stats(0.050 * scale)
        t["cost_aware@80"]["server_s"] = stats(0.054 * scale)  # 4 ms (x scale) more in the prefill
    out = paired_phases(trials, 80)
    assert set(out) == {"cost_aware"}  # timeout / whole_task have no stats: no pairs made up
    ca = out["cost_aware"]
    assert ca["requests"] == 20
    assert ca["prefill"]["median"] == pytest.approx(8.0) and ca["prefill"]["mean"] == pytest.approx(8.0)
    assert ca["entry"] == {"median": 0.0, "mean": 0.0}
    # TTFT: cost_aware 120 / 240 (x scale) against no_prefetch 100 / 200 per request, paired in-trial
    assert ca["ttft"]["mean"] == pytest.approx((9 * 20 + 40 + 9 * 60 + 120) / 20)
    assert paired_phases(trials, 2000) == {}  # no stats at that speed


def test_the_model_runs_bf16_only_where_the_cpu_computes_it_natively(tmp_path):
    from scripts.sglang_server import Model, default_dtype, native_bf16

    ice_lake = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\nmodel\t\t: 106\n"
    sapphire = "flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
    graviton = "Features\t: fp asimd bf16 i8mm\n"
    assert not native_bf16(ice_lake) and native_bf16(sapphire) and native_bf16(graviton)
    assert not native_bf16("model name\t: avx512_bf16 in a name is not a flag\n")
    for text, want in ((ice_lake, "float32"), (sapphire, "bfloat16")):
        f = tmp_path / "cpuinfo"
        f.write_text(text)
        assert default_dtype(str(f)) == want
    assert default_dtype(str(tmp_path / "missing")) == "bfloat16"  # unreadable: the model as sized
    # the KV a block holds follows the dtype, in the sidecar's layout and in SGLang's config
    bf16, fp32 = Model(), Model(dtype="float32")
    assert fp32.block_bytes == 2 * bf16.block_bytes
    assert fp32.config()["torch_dtype"] == "float32" and bf16.config()["torch_dtype"] == "bfloat16"
    assert fp32.sidecar_overrides(tmp_path)["layout.dtype"] == "float32"


def test_every_server_is_told_the_models_dtype(tmp_path):
    from scripts.sglang_server import Model
    from scripts.sglang_ttft import Bench

    for dtype in ("bfloat16", "float32"):
        b = Bench(tmp_path / dtype, Model(dtype=dtype), [2000.0], 1, {"requests": 4, "probes": 1}, ("no_prefetch",),
                  ("cost_aware",), 8, False)
        args = b.server_args
        assert args[args.index("--dtype") + 1] == dtype
        b.server_times = True
        assert "--enable-metrics" in b.server_args and b.server_args[b.server_args.index("--dtype") + 1] == dtype


@pytest.mark.parametrize("flag, value", [("--setups", "none,kvsidecar"), ("--kvs-arms", "cost_aware,costaware")])
def test_an_unknown_setup_or_arm_is_refused_before_any_server_starts(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        st.main([flag, value, "--json", str(tmp_path / "x.json"), "--work", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown" in err and value.split(",")[-1 if flag == "--kvs-arms" else 0] in err
    assert not list(tmp_path.iterdir())  # no run folder, no JSON: nothing started


def _run_doc(scales, mean_gap_ms=400.0):
    """A run's JSON as main() writes it, over trials of :func:`_trial` with hit probes."""
    trials = []
    for s in scales:
        t = _trial(s)
        for key, arm in t.items():
            arm["probe"] = {"cold_ms": [200.0 * s], "hit_ms": [(100.0 if "@" in key else 190.0) * s],
                            "hit_storage_tokens": [0 if key == "no_prefetch" else 2048], "outputs_match": True}
        trials.append(t)
    return st.report(trials, [2000.0, 80.0], {"warmup_trials": 1, "model": {"hidden": 8}, "block_bytes": 4096,
                                              "requests": 10, "mean_gap_ms": mean_gap_ms})


def test_combine_pools_the_trials_of_several_runs_and_recomputes_every_figure():
    """A 5 % question needs more trials than one run gives: ``--combine`` pools runs' trials and
    recomputes every figure from them, as one run with all those trials would."""
    a, b = _run_doc([1.0, 1.1]), _run_doc([0.9])
    doc = st.combine([a, b], ["a.json", "b.json"])
    whole = _run_doc([1.0, 1.1, 0.9])
    assert doc["rows"] == whole["rows"] and doc["probe"] == whole["probe"] and doc["pool_hit"] == whole["pool_hit"]
    assert [r["l3"]["bandwidth_mbps"] for r in doc["rows"]] == [2000.0, 80.0]  # every speed a run measured
    assert doc["rows"][0]["pooled"]["ttft_p50_ms"]["n_trials"] == 3
    assert doc["rows"][0]["paired"]["ttft_p50_ms"]["n"] == 3
    assert doc["combined_from"] == [{"file": "a.json", "trials": 2}, {"file": "b.json", "trials": 1}]
    assert doc["requests"] == 10 and doc["mean_gap_ms"] == 400.0 and len(doc["trials"]) == 3


def test_combine_refuses_runs_that_do_not_pool():
    a = _run_doc([1.0])
    with pytest.raises(st.CombineError, match="mean_gap_ms"):
        st.combine([a, _run_doc([1.0], mean_gap_ms=150.0)], ["a.json", "b.json"])
    with pytest.raises(st.CombineError, match="b.json: not a scripts.sglang_ttft JSON"):
        st.combine([a, {"rows": []}], ["a.json", "b.json"])
    with pytest.raises(st.CombineError):
        st.combine([], [])


def test_combine_from_the_command_line_writes_the_pooled_document(tmp_path, capsys):
    import json

    fa, fb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    fa.write_text(json.dumps(_run_doc([1.0, 1.1])))
    fb.write_text(json.dumps(_run_doc([0.9])))
    assert st.main(["--combine", str(fa), str(fb), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["trials"]) == 3 and doc["rows"] == json.loads(json.dumps(_run_doc([1.0, 1.1, 0.9])["rows"]))
    assert "3 trials from 2 runs" in capsys.readouterr().out
    for bad in (tmp_path / "missing.json", out.with_name("broken.json")):
        if bad.name == "broken.json":
            bad.write_text("{")
        with pytest.raises(SystemExit) as exc:
            st.main(["--combine", str(fa), str(bad), "--json", str(tmp_path / "x.json")])
        assert exc.value.code == 2 and bad.name in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
