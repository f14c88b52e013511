"""The generic HiCache storage interface of the kvsidecar backend: whole pages as uint8 tensors
(this rank's shard), for SGLang code that does not use the v1 zero-copy calls.

Every call goes through the backend's v1 machinery (``batch_exists``, ``_store``, the pooled
connection's copier, which checks block ids and sizes before a byte moves): a miss is ``None``
/ ``False``, never an exception into SGLang.  A mixin of
:class:`kvsidecar.connector.hicache_backend.KvSidecarHiCacheStorage`.
"""

from __future__ import annotations

from .kv_copy import KVShapeError


class GenericPageInterface:
    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if out else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Values as uint8 tensors (or copied into ``target_locations`` tensors); None per miss."""
        import torch

        chain = self._chain(keys)

        def run(c):
            lease = c.get(chain)
            out = []
            try:
                good = c.verified(lease, 0, lease.count)
                for i in range(len(keys)):
                    if i >= good:
                        out.append(None)
                        continue
                    data = torch.frombuffer(bytearray(c.copier.read_shard(lease.blocks[i])), dtype=torch.uint8)
                    if target_locations is not None and target_locations[i] is not None:
                        target_locations[i].view(torch.uint8).view(-1).copy_(data)
                        out.append(target_locations[i])
                    else:
                        out.append(data)
            finally:
                c.release(lease)
            return out

        return self._call(run, [None] * len(keys))

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value] if value is not None else None,
                              [target_location] if target_location is not None else None)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Store whole-page values (tensors of exactly one shard's bytes)."""
        import torch

        src = values if values is not None else target_locations
        if src is None or len(src) != len(keys):
            return False
        if not self.writer:
            return True
        chain = self._chain(keys)

        def run(c):
            st = self._store(c, chain, keys)
            if not st.count:
                return True
            for i, b in enumerate(st.blocks):
                try:
                    c.copier.write_shard(b, src[st.start + i].contiguous().view(-1).view(torch.uint8).numpy())
                except KVShapeError:
                    c.commit(st, ok=False)
                    return False
            r = c.commit(st)
            return bool(r.get("published") or r.get("pending"))

        return self._call(run, False)
