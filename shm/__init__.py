"""Shared-memory primitives with no policy: segments, rings, doorbells, the wire protocol.

``shm`` is the only contract between ``sidecar`` (the per-node process) and
``connector`` (imported by each engine rank); neither imports the other.
"""
