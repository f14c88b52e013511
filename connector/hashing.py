"""Token ids → chained 128-bit block keys (the sidecar never sees token ids).

The chain seed is ``H("kvsidecar-chain-v1" ‖ layout fingerprint ‖ namespace)``, so the
same tokens under another namespace (tenant, LoRA, cache salt) or another KV layout
share no key.  See ``native/hashing.pyx`` for the chaining itself.
"""

from __future__ import annotations

import array

from kvsidecar._native.hashing import chain_hashes, murmur3_128
from kvsidecar.shm.chain import KEY_BYTES
from kvsidecar.shm.layout import KVLayout



class BlockHasher:
    def __init__(self, layout: KVLayout, namespace: str = ""):
        self.layout = layout
        self.namespace = namespace
        self.seed = murmur3_128(b"kvsidecar-chain-v1" + layout.fingerprint() + namespace.encode())

    def chain(self, tokens) -> bytes:
        """Keys of every full block of ``tokens`` (a sequence of ints, array or 1-D tensor)."""
        buf = _as_u32(tokens)
        return chain_hashes(self.seed, buf, self.layout.tokens_per_block)

    @staticmethod
    def num_blocks(chain: bytes) -> int:
        return len(chain) // KEY_BYTES


def _as_u32(tokens):
    """``tokens`` as unsigned 32-bit ids (each id modulo 2**32).  A list or tuple of ids in range
    converts at C speed; anything else (negative or wide ids, numbers of other types) takes the
    element-wise path, which gives the same ids: this runs on the engine's loop for every request."""
    if isinstance(tokens, array.array) and tokens.typecode == "I":
        return tokens
    if type(tokens) is list or type(tokens) is tuple:
        try:
            return array.array("I", tokens)
        except (OverflowError, TypeError):
            pass
    try:
        import torch

        if isinstance(tokens, torch.Tensor):
            out = array.array("I")
            out.frombytes(tokens.detach().to("cpu", torch.int32).contiguous().view(torch.uint8)
                          .numpy().tobytes())
            return out
    except ImportError:
        pass
    return array.array("I", (int(x) & 0xFFFFFFFF for x in tokens))
