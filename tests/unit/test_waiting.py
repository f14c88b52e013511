"""The tests' own waiting helper: it returns what it waited for, and on timeout says what it
waited for and what it last saw."""

from __future__ import annotations

import itertools

import pytest

from ..waiting import wait_until


def test_returns_the_first_truthy_value():
    n = itertools.count()
    assert wait_until(lambda: next(n) >= 3 and "done", 10, "the fourth call") == "done"


def test_until_tests_the_value_and_returns_it():
    n = itertools.count()
    assert wait_until(lambda: {"k": next(n)}, 10, "k reaching 2", until=lambda d: d["k"] == 2) == {"k": 2}


def test_timeout_names_what_and_the_last_value():
    with pytest.raises(AssertionError, match=r"waiting for the impossible; last observed: \{'state': 'running'\}"):
        wait_until(lambda: {"state": "running"}, 0.05, "the impossible", until=lambda d: d["state"] == "done")
