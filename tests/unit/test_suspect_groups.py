"""How suspects (jobs whose engine died under them) are split into groups that have the
engine alone, and how those groups halve until the job that kills the engine runs by itself."""

from __future__ import annotations

import math

import pytest

from jobsvc.workers.isolation import SuspectGroup, group_limit, suspect_groups

pytestmark = pytest.mark.unit


def _ids(count: int) -> list[str]:
    return [f"job-{index:03d}" for index in range(count)]


def test_a_full_message_of_new_suspects_runs_as_one_group_charged_one_level_up() -> None:
    ids = _ids(16)
    assert suspect_groups([(job_id, 0) for job_id in ids], 16) == [
        SuspectGroup(tuple(ids), 1)]


def test_each_level_halves_the_groups_and_the_last_levels_run_each_job_alone() -> None:
    ids = _ids(16)
    assert [len(group.job_ids) for group in suspect_groups(
        [(job_id, 1) for job_id in ids], 16)] == [8, 8]
    assert [len(group.job_ids) for group in suspect_groups(
        [(job_id, 3) for job_id in ids], 16)] == [2] * 8
    for level in (4, 9):
        groups = suspect_groups([(job_id, level) for job_id in ids], 16)
        assert [group.job_ids for group in groups] == [(job_id,) for job_id in ids]
        assert all(group.solo and group.charged_level == level + 1 for group in groups)
    assert [group_limit(level, 100) for level in range(8)] == [100, 50, 25, 12, 6, 3, 1, 1]


def test_only_suspects_of_one_level_share_a_group_lower_levels_first_in_message_order() -> None:
    suspects = [("a", 2), ("b", 0), ("c", 2), ("d", 0), ("e", 5), ("f", 2)]
    groups = suspect_groups(suspects, 8)
    assert [group.job_ids for group in groups] == [("b", "d"), ("a", "c"), ("f",), ("e",)]
    assert not groups[0].solo and groups[2].solo


def test_a_group_smaller_than_its_level_allows_is_charged_to_the_level_that_splits_it() -> None:
    # Two suspects of a 16-job message: groups of 8, 4 and 2 would hold them both again.
    (group,) = suspect_groups([("a", 0), ("b", 0)], 16)
    assert group.charged_level == 4 and group_limit(4, 16) == 1
    (group,) = suspect_groups([("a", 1), ("b", 1), ("c", 1)], 16)
    assert group.charged_level == 3 and group_limit(3, 16) == 2


def _deliveries(message: list[str], culprit: str, batch_size: int) -> tuple[int, set[str]]:
    """Deliver a message whose jobs are all suspects again and again, running its groups in
    turn as a worker does; a death of the engine ends the delivery, and the culprit is given
    up once it has killed the engine alone. Returns the deaths and the jobs that succeeded."""
    levels = dict.fromkeys(message, 0)
    succeeded: set[str] = set()
    deaths = 0
    given_up = False
    while len(succeeded) + given_up < len(message):
        for group in suspect_groups([(job_id, levels[job_id]) for job_id in message
                                     if job_id not in succeeded
                                     and not (given_up and job_id == culprit)], batch_size):
            for job_id in group.job_ids:
                levels[job_id] = group.charged_level
            if culprit in group.job_ids:
                deaths += 1
                given_up = group.solo
                break
            succeeded.update(group.job_ids)
    return deaths, succeeded


@pytest.mark.parametrize(("batch_size", "suspects"), [(16, 16), (16, 2), (16, 5), (256, 256),
                                                      (100, 100), (256, 3)])
def test_the_culprit_runs_alone_after_about_log2_deaths_and_every_other_job_succeeds(
        batch_size: int, suspects: int) -> None:
    message = _ids(suspects)
    bound = math.ceil(math.log2(suspects)) + 1
    for culprit in message:
        deaths, succeeded = _deliveries(message, culprit, batch_size)
        assert deaths <= bound, (culprit, deaths)
        assert succeeded == set(message) - {culprit}
    # A full message of a power-of-two batch size takes one death per halving, then one alone.
    if suspects == batch_size == 2 ** (bound - 1):
        assert _deliveries(message, message[-1], batch_size)[0] == bound
