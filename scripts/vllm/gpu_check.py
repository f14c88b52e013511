"""GPU-host check of kvsidecar's vLLM connector (needs CUDA; not run on CPU-only machines).

What the CPU test suite cannot cover: the CUDA copy path (``cudaHostRegister``ed pool, async
host->device copies), a real GPU attention backend's KV layout, TP >= 2 worker processes, and
TTFT.  One run, about a minute plus model load:

    python -m scripts.vllm.gpu_check --model Qwen/Qwen2.5-0.5B-Instruct --tp 2 [--tokens 4096]

1. starts a sidecar (file-store L3 under a temp dir) with the layout derived from vLLM's config;
2. run 1: a cold prefill of a ``--tokens`` prompt (stored through the sidecar by every rank);
3. the sidecar restarts with a cold pool, vLLM's prefix cache is reset;
4. run 2: the same prompt restored from L3 by a prefetch session, loaded by every rank;
5. asserts identical greedy tokens and ``num_cached_tokens`` = the prompt's full blocks, and
   prints one JSON line: TTFT cold vs restored (median of ``--trials``), blocks, TP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--pool-blocks", type=int, default=4096)
    a = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.connector.vllm_config import VllmConnectorConfig, layout_for
    from tests.helpers import wait_l3_idle
    from kvsidecar.sidecar.spawn import SidecarProcess

    instance = f"kvsgpu-{uuid.uuid4().hex[:8]}"
    l3 = tempfile.mkdtemp(prefix="kvsidecar-gpu-l3-")
    layout = layout_for(EngineArgs(model=a.model, tensor_parallel_size=a.tp, block_size=a.block_size)
                        .create_engine_config(), VllmConnectorConfig(model="gpu-check"))
    over = {f"layout.{k}": v for k, v in layout.as_dict().items()}
    over.update({"pool.num_blocks": a.pool_blocks, "l3.file_dir": l3})
    sp = SidecarProcess(instance, overrides=over)
    kv = {"kv_connector": "KvSidecarConnector", "kv_connector_module_path": "kvsidecar.connector.vllm_connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"instance": instance, "model": "gpu-check", "policy": "wait_complete"}}
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, block_size=a.block_size, kv_transfer_config=kv,
              max_model_len=max(2 * a.tokens, 8192), gpu_memory_utilization=0.6)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        for trial in range(a.trials):
            tokens = [(trial * 7919 + i * 31) % 20000 + 100 for i in range(a.tokens)]
            t0 = time.perf_counter()
            cold = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params)[0]
            t_cold = time.perf_counter() - t0
            with KVConnector(instance, layout, group="gpu-check-probe", namespace="vllm/", populate="off") as c:
                wait_l3_idle(c)  # the write-behind PUTs landed
            sp.stop()
            sp = SidecarProcess(instance, overrides=over)
            assert llm.reset_prefix_cache()
            t0 = time.perf_counter()
            warm = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params)[0]
            t_warm = time.perf_counter() - t0
            full = (a.tokens // a.block_size) * a.block_size
            assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids), "tokens differ"
            assert warm.num_cached_tokens >= full - a.block_size, (warm.num_cached_tokens, full)
            rows.append((t_cold, t_warm, warm.num_cached_tokens))
    finally:
        llm.llm_engine.engine_core.shutdown()
        sp.stop()
    print(json.dumps({"model": a.model, "tp": a.tp, "tokens": a.tokens, "block_size": a.block_size,
                      "ttft_cold_s": statistics.median(r[0] for r in rows),
                      "ttft_restored_l3_s": statistics.median(r[1] for r in rows),
                      "cached_tokens": rows[-1][2], "trials": len(rows)}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    sys.exit(main())
