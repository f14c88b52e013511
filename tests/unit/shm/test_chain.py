"""kvsidecar.shm.chain: the one place that knows the layout of a chain and of a block-id list."""

import os

from kvsidecar.shm import chain


def test_chain_slices_and_sizes():
    keys = [os.urandom(16) for _ in range(5)]
    c = b"".join(keys)
    assert chain.length(c) == 5 and chain.length(b"") == 0
    assert chain.key(c, 3) == keys[3]
    assert chain.span(c, 1, 3) == keys[1] + keys[2]
    assert chain.span(c, 4) == keys[4] and chain.span(c, 5) == b""
    assert chain.keys(c) == keys


def test_block_id_lists():
    blob = chain.pack_ids([3, 0, 2**32 - 1])
    assert len(blob) == 3 * chain.ID_BYTES and chain.count(blob) == 3
    assert list(chain.unpack_ids(blob)) == [3, 0, 2**32 - 1]
