"""Stand-in for the CPU kernel package (not on PyPI): only what a Llama needs on the SGLang CPU engine."""

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                  pool_len):
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[offset:offset + (e - s)]
        offset += e - s


__version__ = "0.0.0-standin"


def __getattr__(name):
    """Anything else SGLang imports from the kernel package resolves, and fails loudly if called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not available on this machine")

    missing.__name__ = name
    return missing
