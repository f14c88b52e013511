"""A rank's own mapping of the pool, made fault-free at attach without blocking the engine.

The mechanism (a background ``MADV_POPULATE_READ`` thread, or ``cudaHostRegister`` on CUDA,
pausing while the engine copies) is ``kvsidecar.shm.mapping_populator``, shared with the sidecar's own
mapping; this module is the connector's side of it: its logger and how it picks the device
(the one torch already initialised, see :func:`cuda_device_for_attach`).
"""

from __future__ import annotations

import logging

from kvsidecar.shm.mapping_populator import PoolPopulator as _Populator
from kvsidecar.shm.mapping_populator import cuda_device_for_attach

__all__ = ["PoolPopulator", "cuda_device_for_attach"]


class PoolPopulator(_Populator):
    """A rank's background populate (see ``kvsidecar.shm.mapping_populator``)."""

    log = logging.getLogger(__name__)
