"""Imported by each engine TP rank: attach to the node's sidecar, issue ops, copy KV."""

from kvsidecar.shm.errors import (  # noqa: F401  (re-exported for engine code)
    KvSidecarError,
    RemoteError,
    RequestTimeout,
    SidecarBusy,
    SidecarUnavailable,
)
