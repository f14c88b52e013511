"""connector/hashing.py: token ids of every accepted kind give the same chain (ids modulo 2**32)."""

import array

import pytest
import torch

from kvsidecar.connector.hashing import BlockHasher, _as_u32
from kvsidecar.shm.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16)


def _elementwise(tokens) -> array.array:
    return array.array("I", (int(x) & 0xFFFFFFFF for x in tokens))


@pytest.mark.parametrize("tokens", [
    list(range(64)),
    tuple(range(1000, 1064)),
    [5, -1, 2**32 + 7, 2**33, 0] * 13,  # out of range: the element-wise path, the same ids
    [True, 3.0, 9] * 22,  # numbers of other types
    [],
])
def test_every_kind_of_token_list_gives_the_elementwise_ids(tokens):
    assert _as_u32(tokens) == _elementwise(tokens)


def test_lists_tuples_arrays_and_tensors_hash_to_one_chain():
    h = BlockHasher(LAYOUT, namespace="t")
    ids = [7, 99, 31999, 0, 12] * 20  # 100 tokens: 6 full blocks
    want = h.chain(ids)
    assert len(want) == 6 * 16
    assert h.chain(tuple(ids)) == want
    assert h.chain(array.array("I", ids)) == want
    assert h.chain(torch.tensor(ids, dtype=torch.int64)) == want
    assert h.chain(iter(ids)) == want  # any iterable
    assert h.chain(ids[:-5] + [ids[-5] + 2**32] + ids[-4:]) == want  # modulo 2**32, as documented
    assert h.chain(ids[:50] + [8] + ids[51:]) != want
