"""The live shard set: which shards producers route to as workers come and go."""

from __future__ import annotations

import pytest

from jobsvc.health import ALIVE_SECONDS, Heartbeat, SeenWorker
from jobsvc.routing.live import NoLiveShard, live_shard_ids

pytestmark = pytest.mark.unit


def _seen(shard: int, age_s: float = 1.0, *, stopped: bool = False) -> SeenWorker:
    heartbeat = Heartbeat(shard=shard, worker=f"shard{shard}@host", host="host", pid=1, up_s=1.0,
                          engine_ready=True, batches_in_flight=0, last_batch_finished_s=None,
                          metrics_port=None, stopped=stopped)
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
