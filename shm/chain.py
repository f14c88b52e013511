"""Hash chains and block-id lists as they travel: one bytes blob each (their wire form).

* A **chain** is ``KEY_BYTES × n`` bytes: the 16-byte chained keys of ``n`` blocks (DESIGN §2).
* A **block-id list** is ``ID_BYTES × n`` bytes: packed little-endian uint32 pool block ids.

Every size and slice of either lives here, so no layer writes ``chain[i*16:(i+1)*16]`` by hand.
They are plain functions over ``bytes`` (not wrapper objects): the native index, the copies and
msgpack take the blobs as they are, and the hot path pays no allocation for a view type.
"""

from __future__ import annotations

import array

KEY_BYTES = 16
ID_BYTES = 4


def length(chain: bytes) -> int:
    """Blocks in ``chain``."""
    return len(chain) // KEY_BYTES


def key(chain: bytes, i: int) -> bytes:
    """The key of block ``i``."""
    return chain[i * KEY_BYTES:(i + 1) * KEY_BYTES]


def span(chain: bytes, start: int, end: int | None = None) -> bytes:
    """The keys of blocks ``[start, end)`` (to the end of the chain when ``end`` is None)."""
    return chain[start * KEY_BYTES:] if end is None else chain[start * KEY_BYTES:end * KEY_BYTES]


def keys(chain: bytes) -> list[bytes]:
    return [chain[i:i + KEY_BYTES] for i in range(0, len(chain), KEY_BYTES)]


def count(ids: bytes) -> int:
    """Block ids in a packed list."""
    return len(ids) // ID_BYTES


def unpack_ids(ids: bytes) -> array.array:
    a = array.array("I")
    a.frombytes(ids)
    return a


def pack_ids(ids) -> bytes:
    return array.array("I", ids).tobytes()
