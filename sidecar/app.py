"""Start a sidecar: create segments (mode 0600), run the control loop, clean up on SIGTERM.

``python -m kvsidecar.sidecar --config node.toml --instance kvs0`` (also the ``kvsidecar-launch`` console
script and ``python -m scripts.launch_sidecar``; see ``main``, which returns the exit code).
A stale control segment from a dead sidecar is replaced and the generation is
bumped past it, so clients of the old incarnation fail fast and re-attach.
A live sidecar under the same instance name is never replaced.

SIGTERM/SIGINT during start-up (the pool allocation can take a while for a large
pool) stops it within one chunk: everything created so far is unlinked and the
launcher exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from kvsidecar.shm.control import ControlSegment, control_segment_bytes, process_start_ticks
from kvsidecar.shm.deathword import DEATH_WORD_OFFSET
from kvsidecar.shm.errors import SegmentError
from kvsidecar.shm.segment import Segment, segment_exists, unlink_segment

from kvsidecar.sidecar.config import SidecarConfig, load_config
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.kv.state import KVState
from kvsidecar.sidecar.l3.base import L3Error
from kvsidecar.sidecar.l3.calibrate import Calibration
from kvsidecar.sidecar.l3.tier import L3Tier
from kvsidecar.sidecar.l3.cost_model import ReadCostModel
from kvsidecar.sidecar.l3.ops import L3Ops
from kvsidecar.sidecar.l3.write_gate import WriteBehindGate
from kvsidecar.sidecar.prefetch.sessions import SessionManager
from kvsidecar.sidecar.observe.metrics import MetricsError, MetricsService
from kvsidecar.sidecar.observe.outcome import Observers
from kvsidecar.sidecar.observe.sessionlog import SessionLog
from kvsidecar.sidecar.kv.pool_memory import StartupInterrupted, create_pool_segment, sidecar_populator
from kvsidecar.sidecar.runtime.loop import ControlLoop

log = logging.getLogger(__name__)


class AlreadyRunning(SegmentError):
    """Another live sidecar owns this instance name."""


def _previous_generation(name: str) -> int:
    """Generation of a stale segment (0 if none); refuses if its owner still lives."""
    if not segment_exists(name):
        return 0
    try:
        seg = Segment.attach(name, readonly=True)
    except SegmentError:
        return 0
    try:
        try:
            old = ControlSegment(seg)
        except SegmentError:
            return 0
        pid, start, gen = old.sidecar_pid, old.sidecar_start_ticks, old.generation
        if pid != os.getpid() and pid and process_start_ticks(pid) == start:
            raise AlreadyRunning(f"sidecar pid {pid} still serves {name}")
        return gen
    finally:
        seg.close()


class SidecarApp:
    """Owns the segments of one sidecar and the :class:`ControlLoop` over them (``loop``)."""

    def __init__(self, cfg: SidecarConfig, stop: threading.Event | None = None):
        """``stop``, when set during start-up, interrupts the pool allocation (StartupInterrupted)."""
        self.cfg = cfg
        self.t_start = time.monotonic()
        self.segments: list[Segment] = []
        self.loop = None
        self.master = None
        self.tier = None
        self.calibration = None  # (owns the scratch mapping registered with the backend: lives as long)
        self.metrics = None
        self.populator = None  # the sidecar's own mapping, populated after ready (with an L3)
        self._closed = False
        self.exit_code = 0
        prev = _previous_generation(cfg.control_name)
        self.generation = max(prev + 1, time.time_ns() // 1000)
        t = cfg.transport
        size = control_segment_bytes(t.num_slots, t.ring_bytes)
        if prev:
            log.warning("replacing stale control segment %s (generation %d)", cfg.control_name, prev)
        unlink_segment(cfg.control_name)
        self.control_segment = Segment.create(cfg.control_name, size)
        self.segments.append(self.control_segment)
        try:
            self.ctl = ControlSegment.initialize(
                self.control_segment, generation=self.generation, num_slots=t.num_slots,
                ring_capacity=t.ring_bytes, instance=cfg.instance,
            )
            layout = cfg.kv_layout()
            self.pool_segment = create_pool_segment(cfg, layout.block_bytes * cfg.pool.num_blocks, stop=stop)
            self.segments.append(self.pool_segment)
            self.ctl.set_pool_name(self.pool_segment.name)
            # a killed client is seen before its address space is torn down (kvsidecar.shm.deathword)
            self.loop = ControlLoop(cfg, self.ctl, layout=layout.as_dict(),
                                   death_word_of=lambda key: self.ctl.slot_addr(key[0]) + DEATH_WORD_OFFSET)
            # The composition root: every edge between the services is a constructor argument
            # here.  The block state first (kv/), then what shares it (the L3 tier reads the
            # checksums, L3Ops stages restores and pins write-behind PUTs), then the KV ops (a
            # published store is followed by L3 write-behind), then the sessions (they claim
            # through the pool manager, which also hands their results off to a GET).
            if not cfg.integrity.checksums:
                log.warning("integrity.checksums = false: no block is verified (stores, GETs and L3 reads)")
            kv = KVState.build(layout, cfg.pool.num_blocks, cfg.limits, checksums=cfg.integrity.checksums)
            l3ops = gate = None
            backend = build_backend(cfg, self)
            if backend is not None:
                backend.register_pool(self.pool_segment.address, self.pool_segment.size)
                if kv.sums is not None:  # each L3 object carries its block's checksum row
                    backend.register_pool(kv.sums.address, kv.sums.size)
                prior = ReadCostModel(cfg.l3.cost_prior_latency_ms / 1e3,
                                      layout.block_bytes / (cfg.l3.cost_prior_mb_per_s * 1e6))
                # L3 reads land through this process's mapping: populated after ready (_announce)
                self.populator = sidecar_populator(cfg, self.pool_segment, l3_on=True)
                self.tier = L3Tier(backend, self.loop.post, fingerprint=layout.fingerprint(),
                                   pool_address=self.pool_segment.address, block_bytes=layout.block_bytes,
                                   cost_model=prior, sums=kv.sums, read_lanes=cfg.l3.read_lanes,
                                   landing=self.populator)
                if cfg.l3.calibration_blocks:  # the estimate measured before the first request needs it
                    self.calibration = Calibration(self.tier, cfg.l3.calibration_blocks,
                                                   on_done=lambda measured: self.sessions.evidence_landed())
                # writes behind only while a read of L3 could pay; told each engine's prefill cost
                # by the sessions' observers, re-measures the tier with the calibration while paused
                gate = WriteBehindGate(self.tier.cost.estimate, cfg.l3.write_behind_max_ratio, cfg.l3.recalibrate_s,
                                       remeasure=self.calibration.start if self.calibration is not None else None)
                l3ops = L3Ops(self.loop, kv, self.tier, cfg.l3.max_put_backlog_blocks, gate=gate)
            self.core = KVCore(self.loop, layout, cfg.pool.num_blocks, cfg.limits, state=kv,
                               after_publish=l3ops.write_behind if l3ops is not None else None)
            if cfg.metrics.enabled:  # off by default (kvsidecar.sidecar.observe.metrics)
                self.metrics = MetricsService(self.loop, cfg.metrics, core=self.core, tier=self.tier,
                                              l3ops=l3ops, generation=self.generation)
            self.sessions = SessionManager(self.core, self.tier, cfg.sessions,
                                           observer=Observers(SessionLog(), self.metrics, gate))
            # (the inspector's tables render from the loop's snapshot: kvsidecar.sidecar.observe.status)
            for service in (self.core, l3ops, self.sessions, self.metrics):
                if service is not None:
                    self.loop.mount(service)
            if self.tier is not None:
                self.tier.start()
                if self.calibration is not None:
                    self.loop.post(self.calibration.start)
            if self.metrics is not None:
                self.metrics.start()
        except BaseException:
            self.close()
            raise

    def ready_marker(self) -> Path:
        return Path(self.cfg.run_dir) / f"{self.cfg.instance}.ready"

    def serve(self, ready_fd: int | None = None) -> None:
        """Run until stopped.  Readiness is announced by the marker file and, when
        ``ready_fd`` is given, by a line written to that pipe (then closed)."""
        marker = self.ready_marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        self.loop.call_at(0.0, self._announce, marker, ready_fd)
        try:
            self.loop.run()
        finally:
            self.close()

    def _announce(self, marker: Path, ready_fd: int | None) -> None:
        log.info("sidecar %s ready: pid %d, generation %d, pool %s (%d MiB), %.2f s after process start "
                 "(%.2f s setting up); %s", self.cfg.instance, os.getpid(), self.generation, self.pool_segment.name,
                 self.pool_segment.size >> 20, _process_age_s(), time.monotonic() - self.t_start, _rss_summary())
        line = f"{os.getpid()} {self.generation}\n"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(line)
        os.replace(tmp, marker)
        if ready_fd is not None:
            try:
                os.write(ready_fd, line.encode())
            finally:
                os.close(ready_fd)
        if self.populator is not None:  # after ready, on its own thread: restores never fault
            self.populator.start()

    def close(self) -> None:
        """Check the books, release every client, unlink the segments (exactly once)."""
        if self._closed:
            return
        self._closed = True
        if self.populator is not None:
            self.populator.stop()  # within one chunk: never populate an address about to be unmapped
        if self.metrics is not None:
            self.metrics.stop()
        if self.loop is not None:
            if self.tier is not None:
                self.tier.stop()  # in-flight L3 calls finish; their completions run below
                self.loop.run_pending_events()
            broken = self.loop.check()
            if broken:
                log.error("accounting invariants broken after draining L3: %s", broken)
                self.exit_code = 3
            self.loop.shutdown()
        if self.master is not None:
            self.master.stop()
        try:
            self.ready_marker().unlink()
        except FileNotFoundError:
            pass
        for seg in self.segments:
            seg.unlink()
            seg.close()
        log.info("sidecar %s stopped; segments unlinked", self.cfg.instance)


def _process_age_s() -> float:
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _rss_summary() -> str:
    """This process's resident memory, split as /proc reports it (shared pool pages are RssShmem)."""
    try:
        with open("/proc/self/status") as f:
            kv = {k: v.split()[0] for k, _, v in (line.partition(":") for line in f)
                  if k in ("VmRSS", "RssAnon", "RssShmem", "VmHWM")}
        return ", ".join(f"{k} {int(kv[k]) >> 10} MiB" for k in ("VmRSS", "RssAnon", "RssShmem", "VmHWM") if k in kv)
    except (OSError, ValueError):
        return "rss unknown"


def build_backend(cfg: SidecarConfig, app: "SidecarApp"):
    """The configured L3 backend (wrapped for shaping/faults when asked), or None."""
    from kvsidecar.sidecar.l3.filestore import FileStore
    from kvsidecar.sidecar.l3.shaped import ShapedBackend

    c = cfg.l3
    if c.backend == "none":
        return None
    if c.backend == "file":
        backend = FileStore(c.file_dir or os.path.join(cfg.run_dir, f"{cfg.instance}-l3"), c.file_cap_bytes,
                            c.file_fsync)
    else:
        from kvsidecar.sidecar.l3.master import MooncakeMaster
        from kvsidecar.sidecar.l3.mooncake import MooncakeBackend

        master = c.mooncake_master
        if c.spawn_local_master:
            app.master = MooncakeMaster(log_path=native_log_path(cfg) if c.native_log == "file" else None)
            master = app.master.address
        if not master:
            raise L3Error("l3.backend = mooncake needs l3.mooncake_master or l3.spawn_local_master")
        backend = MooncakeBackend(master, protocol=c.mooncake_protocol,
                                  global_segment_bytes=c.mooncake_global_segment_bytes,
                                  local_buffer_bytes=c.mooncake_local_buffer_bytes,
                                  setup_timeout_s=c.setup_timeout_s)
    if c.latency_ms or c.bandwidth_mbps or c.fail or c.hang or c.read_gate:
        backend = ShapedBackend(backend, latency_s=c.latency_ms / 1e3, bandwidth_bps=c.bandwidth_mbps * 1e6 / 8,
                                fail=c.fail, fail_prob=c.fail_prob, fail_keys=tuple(c.fail_keys), hang=c.hang,
                                read_gate=c.read_gate)
    return backend


def native_log_path(cfg: SidecarConfig) -> str:
    """Where Mooncake's own (glog) output goes when ``l3.native_log = "file"``."""
    return os.path.join(cfg.run_dir, f"{cfg.instance}-mooncake.log")


def divert_native_output(path: str) -> None:
    """Send fds 1 and 2 (what native libraries such as Mooncake's glog write to) to ``path``,
    and keep this process's Python logging on the console's original stderr."""
    import sys

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    console = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    stream = os.fdopen(console, "w", buffering=1)
    sys.stderr = stream
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setStream(stream)
    log.info("Mooncake's own log goes to %s (l3.native_log = \"console\" shows it here)", path)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Run a kvsidecar process for this node.")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--instance", help="instance name (segment prefix)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set transport.num_slots=8 (TOML value syntax)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ready-fd", type=int, help="write a line to this inherited fd when ready")
    return p


def parse_overrides(items: list[str]) -> dict:
    import tomllib

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set needs KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # a bare string
    return out


def main(argv=None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = parse_overrides(args.set)
    if args.instance:
        overrides["instance"] = args.instance
    cfg = load_config(args.config, overrides)
    if cfg.l3.backend == "mooncake" and cfg.l3.native_log == "file":
        divert_native_output(native_log_path(cfg))
    # Installed before the segments exist: a signal during start-up (a large pool takes a
    # while to allocate) interrupts it between chunks, and what was created is unlinked.
    stop = threading.Event()
    started: list[SidecarApp] = []

    def on_signal(signum, _frame):
        if started:
            started[0].loop.request_stop()
        else:
            stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        app = SidecarApp(cfg, stop=stop)
    except StartupInterrupted:
        log.info("sidecar %s: start-up interrupted by a signal; segments unlinked", cfg.instance)
        return 0
    except (L3Error, SegmentError, MetricsError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    started.append(app)
    if stop.is_set():  # the signal came after the pool was made, before the handler could stop the loop
        app.close()
        log.info("sidecar %s: stopped during start-up; segments unlinked", cfg.instance)
        return 0
    app.serve(args.ready_fd)
    return app.exit_code
