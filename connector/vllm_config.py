"""Typed configuration of the vLLM connector, read from ``kv_connector_extra_config``.

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
                           "kv_connector_module_path": "kvsidecar.connector.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"instance": "kvs0", "policy": "timeout"}}'

Every key is optional; an unknown key or a wrong type is refused at engine start with one line
naming it (:class:`VllmConfigError`).  The KV layout the sidecar must be configured with is
derived from vLLM's own model, cache and parallel config (:func:`layout_for`): vLLM's
``block_size`` is kvsidecar's ``tokens_per_block``.
"""

from __future__ import annotations

import dataclasses
import typing

from kvsidecar.shm.layout import KVLayout, LayoutError

POLICIES = ("timeout", "wait_complete", "best_effort", "cost_aware")
POPULATE = ("background", "sync", "off")
VERIFY = ("off", "sample", "all")


class VllmConfigError(ValueError):
    """The connector's extra config (or the engine's config) cannot be served."""


@dataclasses.dataclass(frozen=True)
class VllmConnectorConfig:
    instance: str = "kvsidecar"  # the node's sidecar (its --instance)
    group: str = ""  # this engine's group on the sidecar; "" = "vllm-" + kv_transfer_config.engine_id
    model: str = ""  # the layout's model name, as in the sidecar's [layout] model; "" = vLLM's model
    namespace: str = ""  # tenant / cache salt: blocks are shared only within one namespace
    # prefetch session started at the request's first match (its scheduling candidacy); the
    # scheduler skips the request (None) while it runs.  best_effort gets no demand here, so it
    # runs to completion like wait_complete.
    policy: str = "timeout"
    budget_s: float | None = None  # timeout's budget (None: the sidecar's formula); cost_aware: a cap
    chunk_max_blocks: int | None = None  # None: the sidecar's sessions.chunk_max_blocks
    store: bool = True  # write computed prompt blocks through the sidecar
    store_to_l3: bool = True  # ... and on to its L3 (write-behind)
    call_timeout_s: float = 2.0  # deadline of one sidecar call; past it the call is a miss
    reattach_every_s: float = 1.0  # a lost sidecar is retried at most this often
    populate: str = "background"  # worker ranks: fault in their pool mapping at attach
    verify_loads: str = "sample"  # worker ranks check leased bytes against their checksums: off|sample|all

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise VllmConfigError(f"kv_connector_extra_config: policy {self.policy!r} is not one of {POLICIES}")
        if self.populate not in POPULATE:
            raise VllmConfigError(f"kv_connector_extra_config: populate {self.populate!r} is not one of {POPULATE}")
        if self.verify_loads not in VERIFY:
            raise VllmConfigError(f"kv_connector_extra_config: verify_loads {self.verify_loads!r} is not one of {VERIFY}")
        for name in ("call_timeout_s", "reattach_every_s"):
            if not getattr(self, name) > 0:
                raise VllmConfigError(f"kv_connector_extra_config: {name} must be > 0")
        if self.budget_s is not None and not self.budget_s > 0:
            raise VllmConfigError("kv_connector_extra_config: budget_s must be > 0")
        if self.chunk_max_blocks is not None and self.chunk_max_blocks <= 0:
            raise VllmConfigError("kv_connector_extra_config: chunk_max_blocks must be > 0")

    @classmethod
    def from_extra(cls, extra: dict | None) -> "VllmConnectorConfig":
        """From ``kv_connector_extra_config``; unknown keys and wrong types are refused."""
        extra = dict(extra or {})
        hints = typing.get_type_hints(cls)
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise VllmConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} "
                                  f"(known: {', '.join(known)})")
        for key, value in extra.items():
            if not _type_ok(value, hints[key]):
                raise VllmConfigError(f"kv_connector_extra_config: {key} = {value!r} is not {hints[key]}")
            if hints[key] in (float, float | None) and isinstance(value, int):
                extra[key] = float(value)
        return cls(**extra)


def _type_ok(value, hint) -> bool:
    args = typing.get_args(hint) or (hint,)
    for t in args:
        if t is type(None) and value is None:
            return True
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is str and isinstance(value, str):
            return True
    return False


_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def layout_for(vllm_config, cfg: VllmConnectorConfig) -> KVLayout:
    """The kvsidecar layout of this engine's KV: one block = one vLLM block (``block_size``
    tokens) of every layer of every TP shard.  Refuses what the pool cannot hold."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.pipeline_parallel_size != 1:
        raise VllmConfigError("kvsidecar's vLLM connector supports pipeline_parallel_size 1 only")
    mla = bool(mc.use_mla)
    dtype = cc.cache_dtype
    if dtype == "auto":
        dtype = str(mc.dtype).removeprefix("torch.")
    dtype = _CACHE_DTYPES.get(dtype, dtype)
    try:
        return KVLayout(model=cfg.model or str(mc.model), num_layers=mc.get_num_layers(pc),
                        num_kv_heads=1 if mla else mc.get_total_num_kv_heads(), head_dim=mc.get_head_size(),
                        dtype=dtype, tokens_per_block=cc.block_size, tp_size=pc.tensor_parallel_size, mla=mla)
    except LayoutError as exc:
        raise VllmConfigError(f"this engine's KV cannot be served by kvsidecar: {exc}") from None
