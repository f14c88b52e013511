"""What a queued request will not compute, from its session's view: the ETA input of the
requests behind it."""

from kvsidecar.connector.adapter import blocks_not_computed


def test_a_running_session_counts_its_plan_an_ended_one_its_prefix():
    assert blocks_not_computed(None) == 0 and blocks_not_computed({}) == 0
    assert blocks_not_computed({"state": "querying", "published": 0, "planned": 0}) == 0
    assert blocks_not_computed({"state": "running", "published": 3, "planned": 30, "target": 34}) == 30
    assert blocks_not_computed({"state": "draining", "published": 12, "planned": 8}) == 12  # landed beyond the plan
    assert blocks_not_computed({"state": "terminal", "prefix": 20, "published": 24, "planned": 34}) == 20
    assert blocks_not_computed({"state": "terminal", "status": "cost", "prefix": 0, "planned": 34}) == 0
    assert blocks_not_computed({"state": "unknown"}) == 0
