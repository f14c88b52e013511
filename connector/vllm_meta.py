"""What the scheduler side tells every worker rank for one engine step (plain data).

vLLM carries it inside its ``KVConnectorMetadata`` to every TP rank.  All ranks act on the same
plan with the same ``step``, so the sidecar answers their ``get`` / ``store`` with one group
decision (DESIGN §6) and no rank waits on another.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Load chain blocks ``[start, start + len(block_ids))`` into vLLM blocks ``block_ids``."""

    req_id: str  # vLLM's request id (what get_finished reports)
    sreq: str  # the request's id on the sidecar (unique per scheduler incarnation)
    attempt: int
    chain: bytes  # keys of blocks [0, start + n): the GET matches from the chain's start
    start: int  # chain blocks below it are already computed locally (vLLM's prefix cache)
    block_ids: tuple  # vLLM block ids receiving chain blocks start, start+1, ...


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Chain blocks ``[0, len(block_ids))`` are computed after this step: offer them to the pool."""

    req_id: str
    sreq: str
    attempt: int
    chain: bytes  # keys of blocks [0, n)
    block_ids: tuple  # vLLM block ids of chain blocks 0..n-1 (the sidecar picks what it lacks)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    step: int  # the scheduler's step counter: the group-decision key of this step's ops
    loads: tuple = ()
    stores: tuple = ()
