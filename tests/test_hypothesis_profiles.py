"""The property tests' profiles (tests/hypothesis_profiles.py): ci runs each test's own example
count, deep ten times it (Hypothesis's default where a test gives none), an unknown name is refused
naming the choices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import hypothesis_profiles


def _property(count: int | None):
    runs: list[int] = []

    @given(st.integers())
    def prop(x):
        runs.append(x)

    if count is not None:
        prop = settings(max_examples=count, database=None)(prop)
    else:
        prop = settings(database=None)(prop)
    return prop, runs


@pytest.mark.parametrize("count", [7, None])
def test_deep_runs_ten_times_each_tests_own_count(count):
    own = count or settings.default.max_examples
    prop, runs = _property(count)
    prop()
    assert len(runs) == own  # ci: the test's own count
    other, _ = _property(count)
    assert hypothesis_profiles.scale([prop, prop, other, len], hypothesis_profiles.DEEP_FACTOR) == 2
    runs.clear()
    prop()
    assert len(runs) == hypothesis_profiles.DEEP_FACTOR * own  # scaled once, though listed twice


def test_a_profile_is_loaded_by_name_and_an_unknown_one_refused():
    try:
        assert hypothesis_profiles.load(None) == "ci" and hypothesis_profiles.load("deep") == "deep"
        with pytest.raises(ValueError, match="HYPOTHESIS_PROFILE=huge: no such profile; use one of ci, deep"):
            hypothesis_profiles.load("huge")
    finally:
        hypothesis_profiles.load("ci")
