"""A real SGLang server (CPU, tiny dummy-weight Llama, TP=2) with kvsidecar as its HiCache storage
backend.  Slow (startup 30-90 s): outside the default suite; run with
``.sglang-venv/bin/python -m pytest -m "sglang and slow" tests/sglang``.

Three stand-ins outside the L2<->L3 path live in ``server_standins/`` (see its sitecustomize).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sidecar import inspector  # noqa: E402
from sidecar.l3.master import free_port  # noqa: E402
from sidecar.spawn import SidecarProcess  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TP = 2
PAGE = 16


def http(port, path, body=None, method="POST", timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode()


def generate(port, ids):
    out = http(port, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    return out["output_ids"], out["meta_info"]


@pytest.fixture
def server(instance, tmp_path):
    cfg = json.loads((HERE / "tiny_llama" / "config.json").read_text())
    heads = cfg["num_key_value_heads"] // TP
    over = {"layout.model": "tiny", "layout.num_layers": cfg["num_hidden_layers"], "layout.num_kv_heads": heads,
            "layout.head_dim": cfg["hidden_size"] // cfg["num_attention_heads"], "layout.dtype": "bfloat16",
            "layout.tokens_per_block": PAGE, "pool.num_blocks": 2048, "l3.file_dir": str(tmp_path / "l3")}
    sc = SidecarProcess(instance, overrides=over)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{HERE / 'server_standins'}:{ROOT}", SGLANG_USE_CPU_ENGINE="1",
               SGLANG_CPU_OMP_THREADS_BIND="0|1", MC_TCP_BIND_ADDRESS="127.0.0.1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"),
               SGLANG_CACHE_DIR=str(ROOT / ".cache" / "sglang"), TMPDIR=str(tmp_path))
    extra = {"backend_name": "kvsidecar", "module_path": "connector.hicache_backend",
             "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "instance": instance, "model": "tiny",
             "l3": True, "timeout_s": 1.0}
    log = open(tmp_path / "server.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(ROOT / ".sglang-venv" / "bin" / "python"), "-m", "sglang.launch_server",
         "--model-path", str(HERE / "tiny_llama"), "--device", "cpu", "--load-format", "dummy",
         "--skip-tokenizer-init", "--tp", str(TP), "--port", str(port), "--host", "127.0.0.1",
         "--page-size", str(PAGE), "--max-total-tokens", "8192", "--enable-hierarchical-cache",
         "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
         "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                http(port, "/health", method="GET", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(1)
        startup = time.monotonic() - t0
        yield port, sc, startup, tmp_path / "server.log"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        log.close()
        sc.stop()
        for name in os.listdir("/dev/shm"):  # the killed sidecar's segments, and SGLang's own leftovers
            if name.startswith(instance) or (name.startswith(("sglang", "sgl_", "psm_"))
                                             and os.stat(f"/dev/shm/{name}").st_uid == os.getuid()):
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass


def flush(port):
    deadline = time.monotonic() + 60
    while True:
        msg = http(port, "/flush_cache")
        if "flushed" in str(msg).lower() and "not" not in str(msg).lower().split("flushed")[0]:
            return
        assert time.monotonic() < deadline, msg
        time.sleep(1)


def published_blocks(instance) -> int:
    """Blocks the sidecar has published from stores, read from its shared stats (the read-only
    inspector: no request, no client slot, nothing the server's ranks could notice)."""
    return inspector.snapshot(instance)["stats"].get("store", {}).get("published_blocks", 0)


def wait_published(instance, at_least: int, timeout_s: float, what: str) -> int:
    """Bounded wait until the sidecar has published ``at_least`` blocks (SGLang writes through to
    its storage backend from each rank's backup thread, asynchronously: possibly after the request
    has returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = published_blocks(instance)
        if n >= at_least:
            return n
        assert time.monotonic() < deadline, f"{what}: {n} of {at_least} blocks published in {timeout_s:.0f} s"
        time.sleep(0.1)


def test_full_server_tp2_serves_cached_tokens_from_kvsidecar(server, instance):
    port, sidecar, startup, log_path = server
    import random

    rng = random.Random(1)
    warm = [rng.randrange(3, 500) for _ in range(64)]
    generate(port, warm)
    # The warm prompt's pages reach the sidecar from both ranks' backup threads, which hash them
    # first: that builds SGLang's native page hash (a JIT compile of seconds) in every rank.
    # Once they have landed, nothing is warming up any more.
    t_warm = time.monotonic()
    base = wait_published(instance, TP * (len(warm) // PAGE), 240, "the warm prompt's write-through")
    t_warm = time.monotonic() - t_warm
    ids = [rng.randrange(3, 500) for _ in range(320)]
    t0 = time.monotonic()
    first, meta1 = generate(port, ids)
    # write-through to the storage backend is asynchronous: every full page of the prompt, from
    # every rank, is in the sidecar before the flush
    written = wait_published(instance, base + TP * (len(ids) // PAGE), 60, "the prompt's write-through")
    flush(port)
    second, meta2 = generate(port, ids)
    storage = (meta2.get("cached_tokens_details") or {}).get("storage", 0)
    assert second == first, (first, second)
    assert storage >= 256, meta2  # 320 tokens: at least 16 of the 20 full pages came from kvsidecar
    assert (meta2.get("cached_tokens_details") or {}).get("storage_backend") == "KvSidecarHiCacheStorage"
    # the sidecar dies mid-run: the server keeps serving (misses, recompute)
    sidecar.kill()
    third, meta3 = generate(port, [rng.randrange(3, 500) for _ in range(200)])
    assert len(third) == 8
    flush(port)
    again, _ = generate(port, ids)
    assert again == first
    print(f"\nfull-server test: startup {startup:.1f} s, warm-up write-through {t_warm:.1f} s "
          f"({base} blocks), round trip {time.monotonic() - t0:.1f} s ({written - base} blocks written through), "
          f"storage cached_tokens {storage}")
