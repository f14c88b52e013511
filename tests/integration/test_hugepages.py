"""A hugepage-backed pool (hugetlbfs): same ops, same bytes; skipped where huge pages are unavailable."""

import os

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.kv.pool_memory import HUGE_PAGE, hugetlbfs_mount

from ..helpers import store_get_load_equal


@pytest.fixture
def huge_dir(tmp_path):
    d = hugetlbfs_mount(4 * HUGE_PAGE)
    if d is None:
        pytest.skip("no hugetlbfs mount with free 2 MiB pages on this machine")
    return d


def test_hugepage_pool_round_trip(sidecar_factory, instance, huge_dir):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16, tp_size=1)
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over.update({"pool.num_blocks": 64, "pool.hugepage_dir": huge_dir})
    sidecar_factory(**over)
    path = os.path.join(huge_dir, f"{instance}.pool")
    assert os.path.exists(path) and os.stat(path).st_mode & 0o777 == 0o600
    with KVConnector(instance, lay) as c:
        assert c.pool.name == path
        kv = [tuple(torch.randn(20, 16, 2, 32).half() for _ in range(2)) for _ in range(2)]
        assert store_get_load_equal(c, kv, list(range(16 * 20))) == 20
