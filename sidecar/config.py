"""Typed sidecar configuration: dataclasses loaded from TOML, overridden by flags.

Nothing here reads the environment; the launcher decides what to pass in.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

from kvsidecar.shm.layout import KVLayout, LayoutError


class ConfigError(ValueError):
    """A configuration file or flag has an unknown key or a value of the wrong type."""


@dataclasses.dataclass
class TransportConfig:
    num_slots: int = 16
    ring_bytes: int = 1 << 20
    sidecar_spin_us: float = 200.0  # spin this long after the last work before sleeping
    max_frame_bytes: int = 256 * 1024
    max_blocks_per_request: int = 8192
    # the inspector's tables, published at most this often after work: a full snapshot of every
    # client, lease and retained session, ~0.5 ms of this process each time (measured: 30 % of its
    # CPU for a stream of SGLang queue entries at 100 ms, on cores the engine's ranks compute on)
    stats_interval_ms: float = 1000.0


@dataclasses.dataclass
class PoolConfig:
    """The CPU pool (see ``kvsidecar.sidecar.kv.pool_memory``)."""

    num_blocks: int = 1024
    # how the pages are allocated at start (kvsidecar.sidecar.kv.pool_memory says what each guarantees):
    # "fallocate" (the default: every page reserved, ENOSPC now, never a SIGBUS later; zeroed
    # by its first toucher), "write" (zeros through the file), "map" (fallocate + parallel
    # MADV_POPULATE_READ of the sidecar's mapping before ready), "touch" (the old Python loop),
    # "none" (no reservation: a full /dev/shm is a SIGBUS at first touch; logged as a warning)
    populate: str = "fallocate"
    populate_threads: int = 0  # "map" workers; 0 = min(cpus, 8)
    # The sidecar's own mapping, populated in the background after ready so that L3 reads
    # landing in the pool never take page faults: "auto" (when an L3 backend is configured),
    # "background", "off".  On a CUDA host ``cuda_register`` ("auto": when a CUDA runtime
    # loads and reports a device) registers the mapping with cudaHostRegister instead (pins
    # and populates it; costs a CUDA context on device 0), as the connector does at attach.
    sidecar_populate: str = "auto"
    cuda_register: str = "auto"
    prefault: bool = True  # false = populate "none"
    # 2 MiB pages: "auto" (when the kernel has enough free; logs when it falls back), "on", "off"
    hugepages: str = "auto"
    hugepage_dir: str = ""  # a hugetlbfs mount: back the pool with a file there (mode 0600)


@dataclasses.dataclass
class LimitsConfig:
    reserved_bytes_limit: int = 0  # staging not yet published; 0 = the whole pool
    pinned_bytes_limit: int = 0  # blocks pinned by leases; 0 = the whole pool
    lease_ttl_s: float = 30.0
    staging_ttl_s: float = 30.0
    decision_ttl_s: float = 30.0


@dataclasses.dataclass
class IntegrityConfig:
    # every shard's bytes carry an XXH3-64 checksum computed by its writer (DESIGN §7): commits
    # must carry them, GET replies hand them to the ranks, L3 objects carry them and every
    # block read from L3 is verified before it is published.  false exists to measure the
    # cost (scripts.bench integrity) and is logged as a warning: nothing is verified then.
    checksums: bool = True


@dataclasses.dataclass
class L3Config:
    """The remote tier.  ``backend``: "file" (embedded, the default), "mooncake" or "none"."""

    backend: str = "file"
    file_dir: str = ""  # default: <run_dir>/<instance>-l3
    file_cap_bytes: int = 0  # 0 = unlimited
    file_fsync: bool = False
    mooncake_master: str = ""  # host:port of a running master
    spawn_local_master: bool = False  # or start one on 127.0.0.1 (demo, tests)
    mooncake_protocol: str = "tcp"
    mooncake_global_segment_bytes: int = 256 << 20
    mooncake_local_buffer_bytes: int = 64 << 20
    setup_timeout_s: float = 5.0
    # threads running L3 reads (restores, session chunks) from one priority queue; see
    # kvsidecar.sidecar.l3.workers for why one is the default (scripts.bench l3 measures 1 against 8)
    read_lanes: int = 1
    # Write-behind backlog bound: blocks pinned for L3 PUTs not yet done (0 = a quarter of the
    # pool).  A store that would exceed it (while PUTs are pending) is published in the pool but
    # not written to L3 (counted), so a slow L3 never grows memory or pins without bound.
    max_put_backlog_blocks: int = 0
    # cost_aware's prior for one L3 read (latency + bytes / bandwidth) until reads measure it;
    # conservative (slow) on purpose: before evidence it restores only what hides behind the queue
    cost_prior_latency_ms: float = 5.0
    cost_prior_mb_per_s: float = 10.0
    # at start, the tier writes this many scratch objects and reads them back (1, then all) so
    # that the estimate is measured before the first request (kvsidecar.sidecar.l3.calibrate); 0: off
    calibration_blocks: int = 4
    # Write behind only while L3 could pay (kvsidecar.sidecar.l3.write_gate): a store is kept in the
    # pool only while a block reads (measured) in more than this many times the engines' reported
    # prefill cost per block (0: always write behind).  While it is paused the tier is re-measured
    # (the calibration above, so it needs calibration_blocks > 0) at most every recalibrate_s.
    write_behind_max_ratio: float = 10.0
    recalibrate_s: float = 30.0
    # shaping / faults (tests and benchmarks)
    latency_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    fail: str = ""  # "", "first", "tail", "random", "keys"
    fail_prob: float = 0.0
    fail_keys: list = dataclasses.field(default_factory=list)
    hang: bool = False
    # name of a POSIX semaphore a test holds reads on (kvsidecar.sidecar.l3.shaped); "" = none
    read_gate: str = ""
    # Where the Mooncake client's (and a spawned master's) own glog output goes: "file"
    # (<run_dir>/<instance>-mooncake.log; the launcher's console keeps only kvsidecar's log) or
    # "console" (inherited stderr, as Mooncake prints it)
    native_log: str = "file"


@dataclasses.dataclass
class MetricsConfig:
    """Prometheus exposition (``kvsidecar.sidecar.observe.metrics``); off by default."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464  # 0: any free port (the chosen one is in stats()["metrics"]["port"] and the log)
    # a scrape asks the control thread for a snapshot and waits at most this long; past it the
    # last good snapshot is served and kvsidecar_scrape_stale is 1
    scrape_timeout_s: float = 0.5


@dataclasses.dataclass
class SessionsConfig:
    """Prefetch sessions (DESIGN §5)."""

    policy_override: str = ""  # when set, replaces every request's policy
    default_policy: str = "timeout"
    chunk_max_blocks: int = 128
    window: int = 2  # chunks in flight per session
    timeout_base_s: float = 2.0
    timeout_per_ki_token_s: float = 0.1
    timeout_max_s: float = 30.0
    retained_ttl_s: float = 30.0  # how long a terminal result stays pinned for its GET
    # A stopped session waits for its reads in flight at most drain_floor_s + drain_slack x
    # their expected time (the tier's running estimate), never over drain_timeout_s; a read
    # stuck longer (a dead L3 master) is left behind and its blocks stay staging until it ends.
    drain_timeout_s: float = 2.0
    drain_floor_s: float = 0.1
    drain_slack: float = 4.0
    # cost_aware: the engine's prefill cost of one block when a request does not say (0: unknown,
    # then only what lands before the ETA is restored); a first small chunk probes an L3 that
    # no read has measured yet
    prefill_s_per_block: float = 0.0
    load_s_per_block: float = 0.0
    probe_blocks: int = 4
    # the first chunk is read with the L3 existence query, not after its answer (one L3 round
    # trip less on every hit; a chunk past the hit is fitted to it, or taken back unstarted).
    # Not for wait_complete (one claim) nor a cost_aware probe.
    read_with_query: bool = True
    # cost_aware weighs a block's prefill by the queued requests the engine says it would hold up
    # (``waiting``): each of them starts that much later, while a read holds only the L3 lane.
    # False: every request is planned as if it were alone (its own TTFT only).
    queue_aware: bool = True
    # ... and by the older requests of its engine still reading from L3 that would be ready while
    # its prefill runs (the scan skips them until then, so they would wait for the rest of it:
    # each weighed by that share).  Only with queue_aware.
    ahead_aware: bool = True


@dataclasses.dataclass
class SidecarConfig:
    instance: str = "kvsidecar"
    run_dir: str = "/tmp/kvsidecar"  # ready marker and logs
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    # the engine's KV layout; ranks must attach with the same (kvsidecar.shm.layout is the shared contract)
    layout: KVLayout = dataclasses.field(default_factory=KVLayout)
    pool: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    l3: L3Config = dataclasses.field(default_factory=L3Config)
    sessions: SessionsConfig = dataclasses.field(default_factory=SessionsConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    integrity: IntegrityConfig = dataclasses.field(default_factory=IntegrityConfig)

    def validate(self) -> None:
        t = self.transport
        if not 1 <= t.num_slots <= 1024:
            raise ConfigError("transport.num_slots must be in 1..1024")
        if t.ring_bytes & (t.ring_bytes - 1) or t.ring_bytes < 4096:
            raise ConfigError("transport.ring_bytes must be a power of two >= 4096")
        if t.max_frame_bytes > t.ring_bytes // 2 - 8:
            raise ConfigError("transport.max_frame_bytes must fit in half a ring")
        if not self.instance or len(self.instance) > 40 or "/" in self.instance:
            raise ConfigError("instance must be 1..40 characters without '/'")
        if self.pool.num_blocks <= 0:
            raise ConfigError("pool.num_blocks must be positive")
        modes = ("write", "map", "fallocate", "touch", "none")
        if self.pool.populate not in modes:
            raise ConfigError(f"pool.populate must be one of {modes}")
        if self.pool.hugepages not in ("auto", "on", "off"):
            raise ConfigError("pool.hugepages must be auto, on or off")
        if self.pool.populate_threads < 0:
            raise ConfigError("pool.populate_threads must be >= 0")
        if self.pool.sidecar_populate not in ("auto", "background", "off"):
            raise ConfigError("pool.sidecar_populate must be auto, background or off")
        if self.pool.cuda_register not in ("auto", "on", "off"):
            raise ConfigError("pool.cuda_register must be auto, on or off")
        if not 1 <= self.l3.read_lanes <= 64:
            raise ConfigError("l3.read_lanes must be in 1..64")
        for name in ("reserved_bytes_limit", "pinned_bytes_limit"):
            if getattr(self.limits, name) < 0:
                raise ConfigError(f"limits.{name} must be >= 0")
        lim = self.limits
        if not (lim.lease_ttl_s > 0 and lim.staging_ttl_s > 0 and lim.decision_ttl_s > 0):
            raise ConfigError("limits.lease_ttl_s, staging_ttl_s and decision_ttl_s must be positive")
        if lim.decision_ttl_s > min(lim.lease_ttl_s, lim.staging_ttl_s):
            # a group decision points at a lease or a staging: it must never outlive them
            raise ConfigError(f"limits.decision_ttl_s ({lim.decision_ttl_s}) must be <= lease_ttl_s "
                              f"({lim.lease_ttl_s}) and staging_ttl_s ({lim.staging_ttl_s})")
        policies = ("wait_complete", "timeout", "best_effort", "cost_aware")
        if self.sessions.policy_override not in ("",) + policies or self.sessions.default_policy not in policies:
            raise ConfigError(f"sessions policies must be one of {policies}")
        if self.sessions.chunk_max_blocks <= 0 or self.sessions.window <= 0:
            raise ConfigError("sessions.chunk_max_blocks and sessions.window must be positive")
        if not 0 <= self.l3.calibration_blocks <= 64:
            raise ConfigError("l3.calibration_blocks must be in 0..64")
        if not (self.l3.write_behind_max_ratio >= 0 and self.l3.recalibrate_s > 0):
            raise ConfigError("l3.write_behind_max_ratio must be >= 0 and l3.recalibrate_s positive")
        if not (self.l3.cost_prior_latency_ms >= 0 and self.l3.cost_prior_mb_per_s > 0):
            raise ConfigError("l3.cost_prior_latency_ms must be >= 0 and l3.cost_prior_mb_per_s > 0")
        if not (self.sessions.prefill_s_per_block >= 0 and self.sessions.load_s_per_block >= 0
                and self.sessions.probe_blocks >= 0):
            raise ConfigError("sessions.prefill_s_per_block, load_s_per_block and probe_blocks must be >= 0")
        if self.l3.backend not in ("file", "mooncake", "none"):
            raise ConfigError("l3.backend must be file, mooncake or none")
        if self.l3.native_log not in ("file", "console"):
            raise ConfigError("l3.native_log must be file or console")
        m = self.metrics
        if not 0 <= m.port <= 65535 or m.scrape_timeout_s <= 0:
            raise ConfigError("metrics.port must be in 0..65535 and metrics.scrape_timeout_s positive")
        if self.l3.fail not in ("", "first", "tail", "random", "keys"):
            raise ConfigError("l3.fail must be one of '', first, tail, random, keys")

    def kv_layout(self) -> KVLayout:
        return self.layout

    @property
    def control_name(self) -> str:
        return f"/{self.instance}.ctl"

    @property
    def pool_name(self) -> str:
        return f"/{self.instance}.pool"


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown key {key!r}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            try:
                kwargs[key] = _build(hint, value, f"{where}.{key}")
            except LayoutError as exc:
                raise ConfigError(f"{where}.{key}: {exc}") from None
            continue
        kwargs[key] = _coerce(hint, value, f"{where}.{key}")
    return cls(**kwargs)


def _coerce(hint, value, where: str):
    origin = typing.get_origin(hint)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table")
        return dict(value)
    return value


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> SidecarConfig:
    """Load TOML (optional) then apply dotted ``overrides`` like ``{"transport.num_slots": 8}``."""
    data: dict = {}
    if path is not None:
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    cfg = _build(SidecarConfig, data, "config")
    cfg.validate()
    return cfg
