"""vLLM's real ``Scheduler`` with kvsidecar's connector, and a model runner played by the test.

:class:`Engine` builds a genuine ``vllm.v1.core.sched.scheduler.Scheduler`` from a ``VllmConfig``
(the tiny Llama's config.json written at test time; nothing is downloaded), whose connector
is ``kvsidecar.connector.vllm_connector.KvSidecarConnector`` loaded out of tree by vLLM's own factory.  It
also holds a WORKER-role instance of the same class over CPU KV tensors shaped as vLLM's CPU
backend registers them (``[blocks, kv_heads, block_size, 2 x head_dim]`` per layer).

:meth:`Engine.step` is one engine iteration as vLLM's model runner runs it: ``schedule()``,
bind the connector metadata, "compute" the scheduled tokens (each full block's KV is a pure
function of its chain key and layer, :func:`block_bytes`; partial blocks get junk), start the
loads, ``wait_for_save``, ``get_finished`` / ``get_block_ids_with_load_errors``, one sampled
token per request that finished its prompt, and ``update_from_output``.  So every block vLLM
thinks is computed can be checked byte for byte (:meth:`Engine.check_blocks`).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

from kvsidecar.shm.chain import key as chain_key  # noqa: E402

BLOCK = 32  # vLLM's block_size == kvsidecar's tokens_per_block (the CPU backend wants multiples of 32)
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 64  # tests/vllm/tiny_llama.py
MODEL = "tiny-llama"


def sidecar_overrides(tmp_path, num_blocks: int = 256, **extra) -> dict:
    """The sidecar's layout for the tiny Llama under vLLM, a pool and a file-store L3."""
    d = {"layout.model": MODEL, "layout.num_layers": LAYERS, "layout.num_kv_heads": KV_HEADS,
         "layout.head_dim": HEAD_DIM, "layout.dtype": "bfloat16", "layout.tokens_per_block": BLOCK,
         "layout.tp_size": 1, "pool.num_blocks": num_blocks, "l3.file_dir": str(tmp_path / "l3")}
    d.update(extra)
    return d


def block_bytes(key: bytes, layer: int) -> torch.Tensor:
    """The KV page [H, N, 2*D] (bf16) this test's 'model' computes for a full block."""
    seed = int.from_bytes(key[:8], "little") ^ (layer * 0x9E3779B97F4A7C15 & (2**64 - 1))
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randn(KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)


class Engine:
    def __init__(self, model_dir, instance: str, *, num_gpu_blocks: int = 64, policy: str = "recompute",
                 extra: dict | None = None, max_num_batched_tokens: int = 4096, engine_id: str | None = None):
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                                 VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.structured_output import StructuredOutputManager

        from kvsidecar.connector.vllm_connector import KvSidecarConnector

        model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                   max_model_len=1024, seed=0)
        extra_config = {"instance": instance, "model": MODEL, "call_timeout_s": 2.0, "reattach_every_s": 0.05,
                        "populate": "off", "verify_loads": "all",
                        **(extra or {})}
        kv_transfer = KVTransferConfig(kv_connector="KvSidecarConnector",
                                       kv_connector_module_path="kvsidecar.connector.vllm_connector", kv_role="kv_both",
                                       kv_load_failure_policy=policy, kv_connector_extra_config=extra_config,
                                       **({"engine_id": engine_id} if engine_id else {}))
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=1024, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            kv_transfer_config=kv_transfer, device_config=DeviceConfig("cpu"))
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_gpu_blocks, layers=[n], layer_stride=0, block_stride=page)
                              for n in layer_names],
            kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)])
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK, log_stats=True)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.sched_conn = self.scheduler.connector
        assert isinstance(self.sched_conn, KvSidecarConnector)
        self.worker_conn = KvSidecarConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = {n: torch.zeros(num_gpu_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
                   for n in layer_names}
        self.worker_conn.register_kv_caches(self.kv)
        self.chains: dict[str, bytes] = {}
        self.outputs: dict[str, list] = {}
        self.finished: dict[str, object] = {}
        self.prefill: dict[str, object] = {}
        self.block_ids: dict[str, list] = {}  # each request's vLLM blocks when last scheduled  # vLLM's PrefillStats per request (external tokens)
        self.load_errors_seen: set[int] = set()
        self.finished_recving_seen: set[str] = set()
        self.steps = 0

    # -- requests -----------------------------------------------------------------------------
    def add(self, rid: str, prompt: list, max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(rid, prompt, sp, None, block_hasher=self.block_hasher)
        self.chains[rid] = self.sched_conn.scheduler.conn.hasher.chain(prompt)
        self.outputs[rid] = []
        self.scheduler.add_request(req)
        return req

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def request(self, rid: str):
        return self.scheduler.requests.get(rid)

    # -- one engine iteration -------------------------------------------------------------------
    def step(self, before_load=None):
        """One iteration; ``before_load(scheduler_output)`` runs between the schedule and the
        workers' loads (a fault can be injected there)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        so = self.scheduler.schedule()
        w = self.worker_conn
        w.bind_connector_metadata(so.kv_connector_metadata)
        self._compute(so)
        if before_load is not None:
            before_load(so)
        w.start_load_kv(None)
        w.wait_for_save()
        _, recving = w.get_finished(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.load_errors_seen |= errors
        self.finished_recving_seen |= set(recving or ())
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done_prompt = req.num_computed_tokens >= req.num_tokens  # (advanced by schedule())
            tok = [7 + len(self.outputs[rid])] if done_prompt else []
            sampled.append(tok)
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(finished_recving=recving or set(),
                                                                      invalid_block_ids=errors))
        eco = self.scheduler.update_from_output(so, out)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.prefill_stats is not None:
                    self.prefill[o.request_id] = o.prefill_stats
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        return so

    def run(self, until, max_steps: int = 2000, timeout_s: float = 30.0, before_load=None):
        """Step until ``until()``; every step is bounded, so is the loop."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if until():
                return
            if time.monotonic() > deadline:
                break
            so = self.step(before_load)
            if not so.num_scheduled_tokens:
                # nothing ran: a request waits on its prefetch session (the connector answers
                # None); block on the sidecar until the session ends instead of spinning steps
                side = self.sched_conn.scheduler
                for st in list(side.reqs.values()):
                    side.link.call(lambda st=st: side.conn.wait(st.sreq, attempt=st.attempt, terminal=True,
                                                                timeout_s=1.0))
            w = self.worker_conn.worker
            if w.loads_in_flight:  # a background copy runs: let it, instead of spinning the loop
                for ld in list(w._loads.values()):
                    if ld.job is not None:
                        ld.job.result(timeout=5)
        raise AssertionError(f"condition not reached after {self.steps} steps")

    def finish(self, rid: str) -> object:
        self.run(lambda: rid in self.finished)
        return self.finished[rid]

    def _compute(self, so):
        """The forward: write the KV of the tokens scheduled this step."""
        new = {r.req_id: (r.num_computed_tokens, r.block_ids[0]) for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for rid, nct in zip(cached.req_ids, cached.num_computed_tokens):
            new.setdefault(rid, (nct, None))
        for rid, n in so.num_scheduled_tokens.items():
            start, _ = new[rid]
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            self.block_ids[rid] = list(ids)
            chain = self.chains[rid]
            for b in range(start // BLOCK, (start + n + BLOCK - 1) // BLOCK):
                full = (b + 1) * BLOCK <= start + n and b < len(chain) // 16
                for li, name in enumerate(self.kv):
                    if full:
                        self.kv[name][ids[b]] = block_bytes(chain_key(chain, b), li)
                    else:
                        self.kv[name][ids[b]].fill_(-1.0)

    # -- checks ---------------------------------------------------------------------------------
    def check_blocks(self, rid: str, nblocks: int) -> None:
        """The first ``nblocks`` of ``rid``'s vLLM blocks (as last scheduled) hold the KV its
        chain computes."""
        ids = self.block_ids[rid]
        chain = self.chains[rid]
        for b in range(nblocks):
            for li, name in enumerate(self.kv):
                assert torch.equal(self.kv[name][ids[b]], block_bytes(chain_key(chain, b), li)), \
                    f"{rid}: block {b} (vLLM {ids[b]}) layer {li} differs"

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker_conn.shutdown()
