"""A genuine SGLang 0.5.23 server on CPU (TP=2, dummy-weight Llama) for benchmarks, and a
streaming client that measures TTFT at the client.

Invariants: every process started here is stopped by :meth:`Server.stop` (process group,
SIGTERM then SIGKILL, bounded); the server's and the sidecar's leftovers in /dev/shm (SGLang's
``sem.mp-*`` and segments, kvsidecar's ``<instance>*``) are removed only when no live process maps
them.  Every wait is bounded.  Runs under ``.sglang-venv/bin/python`` (SGLang and kvsidecar
installed there); the stand-ins outside the L2<->L3 path are ``tests/sglang/server_standins``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
STANDINS = ROOT / "tests" / "sglang" / "server_standins"
TP = 2
PAGE = 16


@dataclasses.dataclass(frozen=True)
class Model:
    """A Llama whose prefill costs tens of ms per 1K tokens on this CPU (random weights).

    Sized by measurement (cold prompts of 16 / 512 / 1,024 / 2,048 tokens, 5 each, a server
    without storage, ``OMP_WAIT_POLICY=PASSIVE``): TTFT medians 31 / 46 / 70 / 100 ms, a marginal
    prefill cost of ~34 ms per 1K tokens over a fixed ~30 ms (forward pass plus one decode step).
    The earlier 64-wide model cost ~6.5 ms per 1K tokens over the same fixed cost, below the 20-60
    ms the benchmark asks for: there a restore could save less than any storage round costs.

    ``dtype``: the weights' and KV's type.  Those figures are bf16 on CPUs with native bf16
    (AVX512-BF16 or AMX); without it torch emulates bf16 and the same prefill is ~4x slower
    (:func:`default_dtype` picks float32 there; the KV blocks are then twice the bytes).
    """

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 2048
    vocab: int = 512
    dtype: str = "bfloat16"

    def config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "num_hidden_layers": self.layers, "vocab_size": self.vocab,
                "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "torch_dtype": self.dtype, "bos_token_id": 1, "eos_token_id": 2}

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_bytes(self) -> int:
        """One kvsidecar block (all ranks): K and V of every layer for PAGE tokens."""
        from kvsidecar.shm.layout import DTYPE_BYTES

        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] * PAGE

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config(), indent=1))
        return folder

    def sidecar_overrides(self, l3_dir: Path, **extra) -> dict:
        d = {"layout.model": "tiny", "layout.num_layers": self.layers, "layout.num_kv_heads": self.kv_heads,
             "layout.tp_size": TP, "layout.head_dim": self.head_dim, "layout.dtype": self.dtype,
             "layout.tokens_per_block": PAGE, "pool.num_blocks": 4096, "l3.file_dir": str(l3_dir)}
        d.update(extra)
        return d


def native_bf16(cpuinfo: str) -> bool:
    """Whether a CPU whose ``/proc/cpuinfo`` text is ``cpuinfo`` computes bf16 natively (x86
    AVX512-BF16 or AMX-BF16, Arm's BF16 extension: ``flags`` / ``Features``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            if {"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()):
                return True
    return False


def default_dtype(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The benchmark model's dtype on this machine: bf16 where the CPU has it natively, else
    float32 (emulated bf16 made the same prefill ~4x slower: a 2K-token recompute 431 ms against
    ~100, the stream's arrivals then overloaded the server).  bf16 where the file is unreadable."""
    try:
        with open(cpuinfo_path) as f:
            text = f.read()
    except OSError:
        return "bfloat16"
    return "bfloat16" if native_bf16(text) else "float32"


def http(port: int, path: str, body=None, method: str = "POST", timeout: float = 120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode()


@dataclasses.dataclass
class Reply:
    ttft_s: float  # request sent -> first streamed chunk with an output token
    e2e_s: float
    output_ids: list
    storage_tokens: int  # SGLang's cached_tokens_details.storage
    cached_tokens: int
    sent_at: float = 0.0  # time.perf_counter() when the request was sent (CLOCK_MONOTONIC)
    # with the server's --enable-metrics: SGLang's own time stats of the request, seconds --
    # queue (waiting queue entry -> forward), prefill (first forward -> prefill finished) and
    # the rest of the TTFT (reception, tokenising, queue entry, streaming the token back)
    server_s: dict | None = None


def stream_generate(port: int, ids: list, max_new_tokens: int = 4, rid: str | None = None,
                    timeout: float = 120) -> Reply:
    """``/generate`` with ``stream``: TTFT at the client from the streaming response."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                  "temperature": 0}}
    if rid is not None:
        body["rid"] = rid
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    wall0 = time.time()  # (SGLang reports its stamps in wall-clock time)
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if ttft is None and msg.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = msg
    e2e = time.perf_counter() - t0
    meta = (last or {}).get("meta_info", {})
    ttft = ttft if ttft is not None else e2e
    server_s = None
    if meta.get("forward_entry_time") and meta.get("prefill_finished_time"):
        queue = float(meta.get("queue_time") or 0.0)
        prefill = meta["prefill_finished_time"] - meta["forward_entry_time"]
        server_s = {"queue": round(queue, 6), "prefill": round(prefill, 6),
                    "entry": round(meta["forward_entry_time"] - queue - wall0, 6),
                    "rest": round(ttft - (meta["prefill_finished_time"] - wall0), 6)}
    return Reply(ttft, e2e, list((last or {}).get("output_ids", [])),
                 int((meta.get("cached_tokens_details") or {}).get("storage", 0) or 0),
                 int(meta.get("cached_tokens", 0) or 0), t0, server_s)


def flush_cache(port: int, timeout_s: float = 60) -> None:
    """SGLang's ``/flush_cache`` (device and host cache), retried while requests drain."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = str(http(port, "/flush_cache")).lower()
        except urllib.error.HTTPError as exc:  # 400 while requests are still pending (write-back, decode)
            msg = f"not flushed: {exc}"
        if "flushed" in msg and "not" not in msg.split("flushed")[0]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"/flush_cache kept refusing: {msg}")
        time.sleep(0.2)


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float
    _log: object

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._log.close()


class PortTaken(RuntimeError):
    """The HTTP port picked for the server was taken before it bound it (SGLang then does not
    exit: it waits in its shutdown with its ranks up)."""


def start_server(model_dir: Path, work: Path, *, storage: str, kvsidecar_cfg: Path | None = None,
                 file_dir: Path | None = None, plugin: bool = True, max_total_tokens: int = 32768,
                 seed: int = 0, start_timeout_s: float = 300, attempts: int = 3, extra_args: tuple = ()) -> Server:
    """``sglang.launch_server --device cpu`` TP=2 with HiCache; ``storage``: ``none`` (HiCache
    without storage), ``kvsidecar`` (dynamic backend; with ``plugin`` the kvsidecar radix cache)
    or ``file`` (SGLang's own file backend in ``file_dir``, its own prefetch policy).  A port
    taken between picking it and SGLang's bind (one of SGLang's own internal ports, or another
    process) is retried on a fresh port, at most ``attempts`` times.  ``extra_args``: more
    ``launch_server`` flags (the benchmark's ``--enable-metrics``)."""
    for attempt in range(1, attempts + 1):
        try:
            return _start_server_once(model_dir, work, storage=storage, kvsidecar_cfg=kvsidecar_cfg,
                                      file_dir=file_dir, plugin=plugin, max_total_tokens=max_total_tokens,
                                      seed=seed, start_timeout_s=start_timeout_s, extra_args=extra_args)
        except PortTaken as exc:
            if attempt == attempts:
                raise
            log.warning("%s; starting again on another port (attempt %d of %d)", exc, attempt + 1, attempts)
    raise AssertionError("unreachable")


def _start_server_once(model_dir: Path, work: Path, *, storage: str, kvsidecar_cfg: Path | None,
                       file_dir: Path | None, plugin: bool, max_total_tokens: int, seed: int,
                       start_timeout_s: float, extra_args: tuple = ()) -> Server:
    from kvsidecar.sidecar.l3.master import free_port

    port = free_port()
    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{STANDINS}:{ROOT}", SGLANG_USE_CPU_ENGINE="1",
               SGLANG_CPU_OMP_THREADS_BIND="0|1", MC_TCP_BIND_ADDRESS="127.0.0.1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"),
               SGLANG_CACHE_DIR=str(ROOT / ".cache" / "sglang"), TMPDIR=str(tmp),
               SGLANG_PLUGINS="kvsidecar" if (storage == "kvsidecar" and plugin) else "none-of-them",
               # SGLang binds each rank's OpenMP threads to its core only on AMX / arm64 CPUs; here
               # each rank runs torch's default two, whose idle workers spin: four spinning threads
               # on two cores.  Measured (same stream, 3 interleaved trials per arm): prefill 82-122
               # us/token with identical batches taking 35-330 ms, stream TTFT p50 130-460 ms;
               # passive: 28-45 us/token, p50 52-58 ms.  Every arm runs with it.
               OMP_WAIT_POLICY="PASSIVE")
    args = [str(ROOT / ".sglang-venv" / "bin" / "python"), "-m", "sglang.launch_server",
            "--model-path", str(model_dir), "--device", "cpu", "--load-format", "dummy", "--random-seed", str(seed),
            "--skip-tokenizer-init", "--tp", str(TP), "--port", str(port), "--host", "127.0.0.1",
            "--page-size", str(PAGE), "--max-total-tokens", str(max_total_tokens), "--enable-hierarchical-cache",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", *extra_args]
    if storage == "kvsidecar":
        extra = {"backend_name": "kvsidecar", "module_path": "kvsidecar.connector.hicache_backend",
                 "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "config_file": str(kvsidecar_cfg)}
        args += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
                 "--hicache-storage-prefetch-policy", "wait_complete"]
        if plugin:
            args += ["--radix-cache-backend", "kvsidecar"]
    elif storage == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(file_dir)
        args += ["--hicache-storage-backend", "file"]
    elif storage != "none":
        raise ValueError(f"storage must be none, kvsidecar or file, not {storage!r}")
    log_path = work / f"server-{storage}-{port}.log"
    log = open(log_path, "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=str(ROOT))
    srv = Server(proc, port, log_path, 0.0, log)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited: {log_path.read_text()[-3000:]}")
            if _bind_failed(log_path, port):
                raise PortTaken(f"SGLang could not bind its HTTP port {port}")
            try:
                http(port, "/health", method="GET", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError("SGLang server did not come up") from None
                time.sleep(1)
    except BaseException:
        srv.stop()
        raise
    srv.startup_s = time.monotonic() - t0
    return srv


def _bind_failed(log_path: Path, port: int) -> bool:
    """Whether the server's log says uvicorn could not bind ``port`` (errno 98)."""
    try:
        text = log_path.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return False
    return "address already in use" in text and f"'127.0.0.1', {port})" in text


def mapped_shm() -> set:
    """Names under /dev/shm that a live process maps or holds open."""
    names = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for sub in ("maps", "fd"):
            try:
                if sub == "maps":
                    with open(f"/proc/{pid}/maps") as f:
                        names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
                else:
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        t = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if t.startswith("/dev/shm/"):
                            names.add(t[len("/dev/shm/"):].split()[0])
            except OSError:
                continue
    return names


def clean_shm(instance_prefix: str, since: float) -> list:
    """Remove what our killed processes left in /dev/shm: kvsidecar segments of our instances,
    SGLang's ``sem.mp-*`` / ``sglang*`` created since ``since``; never one a live process maps."""
    live = mapped_shm()
    removed = []
    for name in os.listdir("/dev/shm"):
        path = f"/dev/shm/{name}"
        try:
            st = os.stat(path)
        except OSError:
            continue
        ours = name.startswith(instance_prefix) or (
            name.startswith(("sem.mp-", "sglang", "sgl_", "psm_")) and st.st_mtime >= since and st.st_uid == os.getuid())
        if ours and name not in live:
            try:
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
    return removed
