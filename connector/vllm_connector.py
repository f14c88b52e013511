"""kvsidecar as a vLLM v1 KV connector, loaded out of tree.

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
                           "kv_connector_module_path": "kvsidecar.connector.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"instance": "kvs0"}}'

vLLM builds one instance in its scheduler (role SCHEDULER: ``kvsidecar.connector.vllm_scheduler``) and
one per worker rank (role WORKER: ``kvsidecar.connector.vllm_worker``); this class only routes vLLM's
calls to the half it is.  The scheduler's plan for a step travels to every rank inside
:class:`KvSidecarMetadata`.  The sidecar being absent, dead or slow is a miss (every call has a
deadline); with ``kv_load_failure_policy: "recompute"`` a load that fails half-way is
recomputed from its first bad block.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .vllm_config import VllmConnectorConfig, layout_for
from .vllm_meta import StepPlan
from .vllm_scheduler import SchedulerSide, _namespace
from .vllm_worker import WorkerSide

log = logging.getLogger(__name__)


class KvSidecarMetadata(KVConnectorMetadata):
    """One step's :class:`StepPlan`, as vLLM carries it from the scheduler to every rank."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class KvSidecarConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = VllmConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.layout = layout_for(vllm_config, self.config)
        self.group = self.config.group or f"vllm-{self._kv_transfer_config.engine_id}"
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.config, self.layout, self.group)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if self.layout.tp_size > 1 else 0
            self.worker = WorkerSide(self.config, self.layout, rank, self.group, _namespace(self.config))
        log.info("kvsidecar connector (%s): instance %r, group %r, layout %s", role.name, self.config.instance,
                 self.group, self.layout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that did not happen is a later miss

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KvSidecarMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output):
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_loads(self._get_connector_metadata().plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request is not in this forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved at wait_for_save, every layer at once

    def wait_for_save(self):
        if self.has_connector_metadata():
            self.worker.save(self._get_connector_metadata().plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.worker.finished()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self):
        for half in (self.scheduler, self.worker):
            if half is not None:
                half.close()
