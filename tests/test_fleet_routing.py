"""Routing through Redis as shards join, leave and drain: new jobs go to live shards only."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import redis

from jobsvc import Client
from jobsvc.health import ALIVE_SECONDS, KEEP_SECONDS, Heartbeat, write_heartbeat
from jobsvc.keys import AFFINITY_KEY, DRAINING_KEY, heartbeat_key
from jobsvc.routing.live import LIVE_SET_SECONDS, LiveShards
from jobsvc.settings import Settings
from jobsvc.workloads import document, question

pytestmark = pytest.mark.integration


def _beat(client: redis.Redis, shard: int) -> None:
    write_heartbeat(client, Heartbeat(
        shard=shard, worker=f"shard{shard}@test", host="test", pid=os.getpid(), up_s=1.0,
        engine_ready=True, batches_in_flight=0, last_batch_finished_s=None, metrics_port=None))


@pytest.mark.parametrize("policy", ["round_robin", "affinity", "cache_aware"])
def test_new_jobs_go_only_to_shards_with_live_workers(routing_settings: Settings,
                                                      policy: str) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    for shard in (1, 3, 9):
        _beat(broker, shard)
    rng = random.Random(7)
    with Client(settings=replace(routing_settings, routing=policy)) as client:
        ids = client.submit_many({"document": document(rng, 120), "question": question(rng)}
                                 for _ in range(24))
        shards = {client.get(job_id).shard for job_id in ids}
    assert shards == {1, 3, 9}


def test_a_document_whose_shard_left_is_placed_anew_and_keeps_its_new_shard(
        routing_settings: Settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    settings = replace(routing_settings, routing="affinity")
    for shard in (2, 6):
        _beat(broker, shard)
    text = document(random.Random(8), 200)
    with Client(settings=settings) as client:
        first = client.get(client.submit(text, "where?")).shard
    other = ({2, 6} - {first}).pop()
    # The first shard's worker falls silent: its last heartbeat ages past ALIVE_SECONDS.
    broker.expire(heartbeat_key(first), int(KEEP_SECONDS - ALIVE_SECONDS) - 1)
    with Client(settings=settings) as client:
        moved = [client.get(client.submit(text, f"again {n}?")).shard for n in range(3)]
    assert moved == [other] * 3
    assert broker.hvals(AFFINITY_KEY) == [str(other).encode()]


def test_a_draining_shard_is_left_out_once_the_live_set_is_read_again(
        routing_settings: Settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    _beat(broker, 0)
    _beat(broker, 4)
    now = [0.0]
    live = LiveShards(broker, routing_settings.shards, clock=lambda: now[0])
    assert live.shards() == (0, 4)
    broker.sadd(DRAINING_KEY, 4)
    now[0] += LIVE_SET_SECONDS / 2
    assert live.shards() == (0, 4)
    now[0] += LIVE_SET_SECONDS
    assert live.shards() == (0,)
