"""Loaded at start-up by every SGLang server process of the full-server test (PYTHONPATH).

Stand-ins outside the L2<->L3 path, as measured in ../shared/sglang-cpu: host pools without pinned
memory (no CUDA driver here), ``transfer_kv_direct`` as plain torch index copies, and no NCCL
communicator for TP>1 (the gloo group does the all-reduce).  ``sgl_kernel`` is a sibling stand-in.

One setting for SGLang's CPU attention, not a stand-in: torch flushes denormal floats to zero
(``torch.set_flush_denormal``, set as torch is imported, before any worker thread exists).
SGLang's ``torch_native`` backend pads an extend's query to the whole sequence with
``torch.empty`` and computes attention over the padding rows too; where the recycled memory
holds denormals, the x86 slow path makes that attention ~50x slower (measured here, one
2,048-token sequence, 8 heads: 2.2-4.0 s against 77 ms).  It stalled 1-3 of every 8 storage
hits after ``/flush_cache`` by 0.4-0.7 s, for kvsidecar and SGLang's ``file`` backend alike
(py-spy: rank 1 inside ``scaled_dot_product_attention`` while rank 0 waited in the all-reduce).
Here only the discarded padding rows hold such values; the benchmark still checks every arm's
outputs against a cold run's (whose server flushes them too).
"""

import importlib.abc
import importlib.machinery
import sys


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_indices.to(dst.device), src.index_select(0, src_indices.to(src.device)))


def _patch(name, module):
    if name == "torch":
        module.set_flush_denormal(True)
    elif name == "sglang.srt.mem_cache.pool_host.base":
        cls = module.HostKVCache
        orig = cls.__init__

        def __init__(self, *args, **kwargs):
            if "pin_memory" in kwargs:
                kwargs["pin_memory"] = False
            orig(self, *args, **kwargs)
            self.pin_memory = False

        cls.__init__ = __init__
    elif name in ("sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.pool_host.mha"):
        module.transfer_kv_direct = _transfer_kv_direct
    elif name == "sglang.srt.distributed.device_communicators.pynccl":
        # The local torch wheel is a CUDA build, so SGLang would set up NCCL for TP>1; on CPU the
        # communicator must disable itself and leave the all-reduce to the gloo group.
        cls = module.PyNcclCommunicator

        def __init__(self, group, device, *args, **kwargs):
            import torch.distributed as dist

            self.group = group
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.available = False
            self.disabled = True
            self.device = device

        cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    targets = {"torch", "sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.memory_pool_host",
               "sglang.srt.mem_cache.pool_host.mha", "sglang.srt.distributed.device_communicators.pynccl"}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.targets:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(fullname, module)

        loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder())


import faulthandler as _fh  # noqa: E402
import signal as _signal  # noqa: E402

_fh.register(_signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every thread's stack
