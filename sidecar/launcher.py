"""Start a sidecar: create segments (mode 0600), run the control loop, clean up on SIGTERM.

``python scripts/launch_sidecar.py --config node.toml --instance kvs0`` (see ``main``).
A stale control segment from a dead sidecar is replaced and the generation is
bumped past it, so clients of the old incarnation fail fast and re-attach.
A live sidecar under the same instance name is never replaced.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

from shm.control import ControlSegment, control_segment_bytes, process_start_ticks
from shm.errors import SegmentError
from shm.segment import Segment, segment_exists, unlink_segment

from .config import SidecarConfig, load_config
from .core import KVCore
from .pool_memory import create_pool_segment
from .server import Sidecar

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


class SidecarHost:
    """Owns the segments of one sidecar and the :class:`Sidecar` loop over them."""

    def __init__(self, cfg: SidecarConfig):
        self.cfg = cfg
        self.segments: list[Segment] = []
        prev = _previous_generation(cfg.control_name)
        self.generation = max(prev + 1, time.time_ns() // 1000)
        t = cfg.transport
        size = control_segment_bytes(t.num_slots, t.ring_bytes)
        if prev:
            log.warning("replacing stale control segment %s (generation %d)", cfg.control_name, prev)
        unlink_segment(cfg.control_name)
        self.control_segment = Segment.create(cfg.control_name, size)
        self.segments.append(self.control_segment)
        self.ctl = ControlSegment.initialize(
            self.control_segment, generation=self.generation, num_slots=t.num_slots,
            ring_capacity=t.ring_bytes, instance=cfg.instance,
        )
        layout = cfg.kv_layout()
        self.pool_segment = create_pool_segment(cfg, layout.block_bytes * cfg.pool.num_blocks)
        self.segments.append(self.pool_segment)
        self.ctl.set_pool_name(self.pool_segment.name)
        self.sidecar = Sidecar(cfg, self.ctl, layout=layout.as_dict())
        self.core = KVCore(self.sidecar, layout, cfg.pool.num_blocks, cfg.limits)
        self._closed = False
        self.exit_code = 0

    def ready_marker(self) -> Path:
        return Path(self.cfg.run_dir) / f"{self.cfg.instance}.ready"

    def serve(self, ready_fd: int | None = None) -> None:
        """Run until stopped.  Readiness is announced by the marker file and, when
        ``ready_fd`` is given, by a line written to that pipe (then closed)."""
        marker = self.ready_marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        self.sidecar.call_at(0.0, self._announce, marker, ready_fd)
        try:
            self.sidecar.run()
        finally:
            self.close()

    def _announce(self, marker: Path, ready_fd: int | None) -> None:
        line = f"{os.getpid()} {self.generation}\n"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(line)
        os.replace(tmp, marker)
        if ready_fd is not None:
            try:
                os.write(ready_fd, line.encode())
            finally:
                os.close(ready_fd)

    def close(self) -> None:
        """Check the books, release every client, unlink the segments (exactly once)."""
        if self._closed:
            return
        self._closed = True
        broken = "; ".join(filter(None, (check() for check in self.sidecar.invariant_checks)))
        if broken:
            log.error("accounting invariants broken at shutdown: %s", broken)
            self.exit_code = 3
        self.sidecar.shutdown()
        try:
            self.ready_marker().unlink()
        except FileNotFoundError:
            pass
        for seg in self.segments:
            seg.unlink()
            seg.close()
        log.info("sidecar %s stopped; segments unlinked", self.cfg.instance)


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
    host = SidecarHost(cfg)
    signal.signal(signal.SIGTERM, lambda *_: host.sidecar.request_stop())
    signal.signal(signal.SIGINT, lambda *_: host.sidecar.request_stop())
    host.serve(args.ready_fd)
    return host.exit_code
