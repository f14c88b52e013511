"""Typed configuration of kvsidecar inside SGLang (the storage backend and the plugin).

Where it comes from, in order (later wins):

1. the defaults below;
2. a TOML file named by ``config_file`` in SGLang's ``--hicache-storage-backend-extra-config``
   (keys of :class:`PluginConfig` at the top level, :class:`SessionConfig` under ``[sessions]``;
   an unknown key or a wrong type is a :class:`PluginConfigError`);
3. the kvsidecar keys given inline in that extra config (``instance``, ``namespace``, ``l3``,
   ``timeout_s``, ...; ``sessions`` as a table).  Other keys of the extra config belong to
   SGLang (``backend_name``, ``prefetch_threshold``, ...) and are left alone.

Nothing is read from the environment.  **kvsidecar's policy decides when a prefetch stops**:
``sessions.policy`` (``timeout`` / ``best_effort`` / ``wait_complete`` / ``cost_aware``), ``chunk_max_blocks``
and ``budget_s`` live here; SGLang itself runs ``--hicache-storage-prefetch-policy
wait_complete`` (the plugin refuses anything else).
"""

from __future__ import annotations

import dataclasses
import tomllib

POLICIES = ("wait_complete", "timeout", "best_effort", "cost_aware")
POPULATE = ("background", "sync", "off")


class PluginConfigError(ValueError):
    """kvsidecar's SGLang configuration is invalid (raised at start, names the key)."""


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    enabled: bool = True  # False: no sessions at all -- batch_exists restores the whole chain itself (blocking)
    policy: str = "timeout"  # kvsidecar's stop policy for every request SGLang prefetches (cost_aware: needs the
    # plugin's ETA hook on Scheduler.get_new_batch_prefill)
    chunk_max_blocks: int = 0  # 0: the sidecar's [sessions] chunk_max_blocks
    budget_s: float | None = None  # timeout policy: None = the sidecar's min(max, base + per_ki_token x tokens)
    query_wait_s: float = 2.0  # batch_exists waits at most this for the L3 metadata answer (no data)
    get_wait_s: float = 30.0  # batch_get_v1 waits at most this for the session's published prefix
    # the scheduler waits at most this per iteration for storage queries just sent and for the copy
    # of hits resident in the pool, so they are admitted in that iteration (0: off; sglang_settle)
    settle_wait_s: float = 0.02
    # cost_aware: start the session at queue entry and, when the sidecar says nothing can be
    # restored (no pool hit, no L3 read that pays), run no SGLang storage operation for the
    # request -- its query, collective drains and admission gate cost a prefill-bound request
    # more than they save (sglang_plugin.EntryGate); the TP group agrees first
    decide_at_entry: bool = True

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise PluginConfigError(f"sessions.policy must be one of {POLICIES}, not {self.policy!r}")
        if self.chunk_max_blocks < 0:
            raise PluginConfigError("sessions.chunk_max_blocks must be >= 0")
        if self.budget_s is not None and self.budget_s <= 0:
            raise PluginConfigError("sessions.budget_s must be > 0")
        if self.query_wait_s <= 0 or self.get_wait_s <= 0:
            raise PluginConfigError("sessions.query_wait_s and sessions.get_wait_s must be > 0")
        if not 0 <= self.settle_wait_s <= 1.0:
            raise PluginConfigError("sessions.settle_wait_s must be within [0, 1] seconds")


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    instance: str = "kvsidecar"  # the node's sidecar (python -m kvsidecar.sidecar --instance ...)
    group: str = ""  # the TP group's name in the sidecar ("" = sglang:<model>:tp<N>:pp<p>:dp<d>)
    namespace: str = ""  # tenant namespace: seeds every key and names the L3 keys
    model: str = ""  # a stable model id for the layout fingerprint ("" = SGLang's model name)
    l3: bool = True  # restore from / write behind to the sidecar's L3 tier
    timeout_s: float = 2.0  # deadline of one sidecar call
    reattach_every_s: float = 1.0  # a thread whose sidecar is down retries at most this often
    populate: str = "background"  # each connection's pool mapping (see kvsidecar.connector.kv_client)
    max_connections: int = 4  # sidecar connections (client slots) per rank, shared by its threads
    verify_loads: str = "sample"  # off | sample | all: check leased bytes against their checksums
    timeline: bool = False  # log one "kvsidecar-timeline" line per storage phase of each request (benchmarks)
    sessions: SessionConfig = SessionConfig()

    def __post_init__(self):
        if not self.instance:
            raise PluginConfigError("instance must be set")
        if self.populate not in POPULATE:
            raise PluginConfigError(f"populate must be one of {POPULATE}")
        if not 1 <= self.max_connections <= 64:
            raise PluginConfigError("max_connections must be between 1 and 64")
        if self.verify_loads not in ("off", "sample", "all"):
            raise PluginConfigError("verify_loads must be off, sample or all")
        if self.timeout_s <= 0 or self.reattach_every_s < 0:
            raise PluginConfigError("timeout_s must be > 0 and reattach_every_s >= 0")


def _typed(cls, data: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            raise PluginConfigError(f"{where}: unknown key {key!r} (known: {sorted(fields)})")
        if f.name == "sessions":
            if not isinstance(value, dict):
                raise PluginConfigError(f"{where}: sessions must be a table")
            out[key] = _typed(SessionConfig, value, f"{where} [sessions]")
            continue
        want = {"str": str, "int": int, "bool": bool, "float": float, "float | None": float}[str(f.type)]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise PluginConfigError(f"{where}: {key} must be {want.__name__}, got {value!r}")
        out[key] = value
    return cls(**out)


def load_plugin_config(extra: dict | None) -> PluginConfig:
    """The configuration for SGLang's storage-backend extra config (see the module doc)."""
    extra = dict(extra or {})
    merged: dict = {}
    path = extra.pop("config_file", None)
    if path:
        try:
            with open(path, "rb") as f:
                merged = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise PluginConfigError(f"cannot read kvsidecar config {path}: {exc}") from None
        _typed(PluginConfig, merged, str(path))  # strict: the file is ours alone
    known = {f.name for f in dataclasses.fields(PluginConfig)}
    for key, value in extra.items():
        if key not in known:
            continue  # SGLang's own keys
        if key == "sessions" and isinstance(value, dict):
            merged["sessions"] = {**merged.get("sessions", {}), **value}
        else:
            merged[key] = value
    return _typed(PluginConfig, merged, "kvsidecar config")
