"""The fleet's membership rules: which shards producers route to, which count as dead, and
which shard numbers a starting worker may take."""

from __future__ import annotations

import pytest

from jobsvc.departures import dead_shards
from jobsvc.errors import ConfigurationError
from jobsvc.health import ALIVE_SECONDS, Heartbeat, SeenWorker
from jobsvc.routing.live import ModelShards, NoLiveShard, live_shard_ids, model_shard_ids
from jobsvc.routing.prefix import adapted, document_keys
from jobsvc.settings import Settings
from jobsvc.workers.bootstrap import held_elsewhere

pytestmark = pytest.mark.unit


def _seen(shard: int, age_s: float = 1.0, *, stopped: bool = False,
          models: tuple[str, ...] = ("jobsvc",)) -> SeenWorker:
    heartbeat = Heartbeat(shard=shard, worker=f"shard{shard}@host", host="host", pid=1, up_s=1.0,
                          engine_ready=True, messages_in_flight=0, last_message_finished_s=None,
                          metrics_port=None, task="generate", models=list(models),
                          stopped=stopped)
    return SeenWorker(heartbeat, age_s)


def test_the_configured_shards_stand_in_until_a_worker_reports() -> None:
    assert live_shard_ids({}, set(), 3) == (0, 1, 2)


def test_live_workers_replace_the_configured_count_whatever_their_numbers() -> None:
    workers = {0: _seen(0), 2: _seen(2), 5: _seen(5)}
    assert live_shard_ids(workers, set(), 2) == (0, 2, 5)


def test_silent_and_stopped_workers_are_left_out() -> None:
    workers = {0: _seen(0), 1: _seen(1, ALIVE_SECONDS + 1), 2: _seen(2, stopped=True)}
    assert live_shard_ids(workers, set(), 3) == (0,)


def test_when_every_worker_is_gone_the_configured_shards_stand_in_again() -> None:
    workers = {4: _seen(4, ALIVE_SECONDS + 1)}
    assert live_shard_ids(workers, set(), 2) == (0, 1)


def test_a_draining_shard_takes_no_new_work() -> None:
    assert live_shard_ids({0: _seen(0), 1: _seen(1)}, {1}, 2) == (0,)
    assert live_shard_ids({}, {0}, 2) == (1,)


def test_nothing_to_route_to_when_every_shard_drains() -> None:
    with pytest.raises(NoLiveShard, match="draining"):
        live_shard_ids({3: _seen(3)}, {3}, 1)


def test_a_models_jobs_go_to_the_live_shards_serving_it_its_adapters_included() -> None:
    workers = {0: _seen(0, models=("a", "a-sql")), 1: _seen(1, models=("b",)),
               2: _seen(2, models=("a",)), 3: _seen(3, ALIVE_SECONDS + 1, models=("b",))}
    registered = {0: ["a", "a-sql"], 1: ["b"], 2: ["a"], 3: ["b"]}
    assert model_shard_ids("a", workers, set(), 1, registered) == ModelShards((0, 2), True)
    assert model_shard_ids("a-sql", workers, set(), 1, registered) == ModelShards((0,), True)
    assert model_shard_ids("b", workers, {1}, 1, registered) == ModelShards((3,), False)


def test_a_model_without_a_live_worker_waits_on_the_shards_that_served_it() -> None:
    workers = {0: _seen(0, models=("a",)), 5: _seen(5, ALIVE_SECONDS + 1, models=("b",))}
    registered = {0: ["a"], 5: ["b"], 7: ["b"]}
    assert model_shard_ids("b", workers, set(), 2, registered) == ModelShards((5, 7), False)
    with pytest.raises(NoLiveShard, match="'b'"):
        model_shard_ids("b", workers, {5, 7}, 2, registered)


def test_until_a_worker_registers_the_configured_shards_stand_in_for_any_model() -> None:
    assert model_shard_ids("a", {}, {1}, 3, {}) == ModelShards((0, 2), True)


def test_adapter_keys_differ_from_the_models_but_keep_shared_blocks_shared() -> None:
    shared = list(range(256))
    first = document_keys([*shared, *range(1000, 1128)], 128)
    second = document_keys([*shared, *range(2000, 2128)], 128)
    first_sql, second_sql = adapted(first, "sql"), adapted(second, "sql")
    assert first_sql.document_key == first.document_key
    assert not set(first_sql.blocks) & set(first.blocks)
    assert first_sql.blocks[:2] == second_sql.blocks[:2]
    assert first_sql.blocks[2] != second_sql.blocks[2]
    assert adapted(first, "legal").blocks[0] != first_sql.blocks[0]
    assert first_sql.prefix_key not in (first.prefix_key, adapted(first, "legal").prefix_key)


def test_a_shard_silent_past_the_timeout_is_dead_and_a_live_one_never() -> None:
    silences = {0: 1.0, 1: 61.0, 2: 30.0, 3: 90.0}
    assert dead_shards(silences, live=[0], timeout_s=60) == {1, 3}
    assert dead_shards(silences, live=[0, 1], timeout_s=60) == {3}


def test_a_worker_never_counts_its_own_shard_dead() -> None:
    assert dead_shards({1: 61.0, 3: 90.0}, live=[0], timeout_s=60, own=1) == {3}


def test_a_shard_number_held_by_a_live_worker_elsewhere_is_refused() -> None:
    elsewhere = _seen(5)
    assert held_elsewhere(elsewhere, "other-host", 42, lambda _pid: False)


def test_a_shard_whose_worker_died_or_went_silent_is_free() -> None:
    def running(_pid: int) -> bool:
        return False

    assert not held_elsewhere(_seen(5, ALIVE_SECONDS + 1), "other-host", 42, running)
    assert not held_elsewhere(_seen(5, stopped=True), "other-host", 42, running)
    # The same host, and the process that wrote the heartbeat is gone: a crashed predecessor.
    assert not held_elsewhere(_seen(5), "host", 42, running)
    # A container restarted with the same name and process ID is that worker again.
    assert not held_elsewhere(_seen(5), "host", 1, lambda _pid: True)


def test_another_running_process_of_this_host_holds_its_shard() -> None:
    assert held_elsewhere(_seen(5), "host", 42, lambda pid: pid == 1)


def test_a_shard_timeout_within_the_heartbeat_limit_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="JOBSVC_SHARD_TIMEOUT"):
        Settings.from_env({"JOBSVC_SHARD_TIMEOUT": str(int(ALIVE_SECONDS) - 1)})
    assert Settings.from_env({}).shard_timeout == 60
