"""The bounded cache of what was made lately: pure logic."""

from __future__ import annotations

import pytest

from jobsvc.recent import Recent

pytestmark = pytest.mark.unit


def test_the_least_recently_used_go_first_to_stay_within_the_bound() -> None:
    recent: Recent[str, int] = Recent(10, lambda key, _value: len(key))
    recent.keep("aaaa", 1)
    recent.keep("bbbb", 2)
    assert recent.get("aaaa") == 1  # now the most recently used
    recent.keep("cccc", 3)
    assert (recent.get("aaaa"), recent.get("bbbb"), recent.get("cccc")) == (1, None, 3)


def test_a_value_larger_than_the_bound_is_not_kept_and_a_kept_key_keeps_its_value() -> None:
    recent: Recent[str, int] = Recent(4, lambda key, _value: len(key))
    recent.keep("too long", 1)
    assert recent.get("too long") is None
    recent.keep("ab", 1)
    recent.keep("ab", 2)
    assert recent.get("ab") == 1
