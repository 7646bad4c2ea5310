"""Routing through Redis as shards join, leave and drain: new jobs go to live shards only."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import redis
from sqlalchemy import select

from jobsvc import Client
from jobsvc.health import ALIVE_SECONDS, KEEP_SECONDS, Heartbeat, write_heartbeat
from jobsvc.keys import (
    AFFINITY_KEY,
    DEPARTED_KEY,
    DRAINING_KEY,
    LOAD_KEY,
    heartbeat_key,
    queue_name,
)
from jobsvc.reconcile import Reconciler
from jobsvc.routing.live import LIVE_SET_SECONDS, LiveShards, ModelShards
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.transport import make_celery
from jobsvc.workloads import document, question
from tests.support.queues import queued_message_ids

pytestmark = pytest.mark.integration


def _beat(client: redis.Redis, shard: int) -> None:
    write_heartbeat(client, Heartbeat(
        shard=shard, worker=f"shard{shard}@test", host="test", pid=os.getpid(), up_s=1.0,
        engine_ready=True, messages_in_flight=0, last_message_finished_s=None, metrics_port=None,
        task="generate", models=["jobsvc"]))


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
    model = routing_settings.served_model_name
    assert live.shards(model) == ModelShards((0, 4), True)
    broker.sadd(DRAINING_KEY, 4)
    now[0] += LIVE_SET_SECONDS / 2
    assert live.shards(model).shards == (0, 4)
    now[0] += LIVE_SET_SECONDS
    assert live.shards(model).shards == (0,)


def test_a_dead_shards_jobs_move_once_to_live_shards_and_its_routing_state_is_forgotten(
        routing_settings: Settings, store: Store) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    settings = replace(routing_settings, routing="affinity", shard_timeout=20)
    for shard in (0, 1):
        _beat(broker, shard)
    rng = random.Random(9)
    texts = [document(rng, 150) for _ in range(6)]
    with Client(settings=settings) as client:
        ids = client.submit_many({"document": text, "question": f"question {n}?"}
                                 for text in texts for n in range(3))
        before = {job_id: client.get(job_id) for job_id in ids}
    stranded = [job_id for job_id, record in before.items() if record.shard == 1]
    assert stranded and len(stranded) < len(ids)
    old_messages = _message_ids(store, stranded)
    # Shard 1's worker has been silent for longer than the timeout.
    broker.expire(heartbeat_key(1), KEEP_SECONDS - settings.shard_timeout - 1)
    reconciler = Reconciler(settings, broker, store, make_celery(settings))
    reconciler.run_round()
    with Client(settings=settings) as client:
        after = {job_id: client.get(job_id) for job_id in ids}
    assert {after[job_id].shard for job_id in ids} == {0}
    assert all(after[job_id].status == "queued" for job_id in ids)
    new_messages = _message_ids(store, stranded)
    assert not new_messages & old_messages
    assert new_messages <= set(queued_message_ids(broker, 0))
    # Shard 1's old messages matched no job any more, and its queue is gone.
    assert not broker.exists(queue_name(1))
    assert b"1" not in broker.hvals(AFFINITY_KEY)
    assert b"1" not in broker.hkeys(LOAD_KEY)
    assert broker.sismember(DEPARTED_KEY, 1)
    # A second round finds nothing of these jobs to move.
    reconciler.run_round()
    assert _message_ids(store, stranded) == new_messages
    # The document keeps its new shard for later questions.
    moved_text = next(text for text, first_id in zip(texts, ids[::3], strict=True)
                      if before[first_id].shard == 1)
    with Client(settings=settings) as client:
        assert client.get(client.submit(moved_text, "later?")).shard == 0


def _message_ids(store: Store, job_ids: list[str]) -> set[str]:
    with store.engine.connect() as connection:
        return set(connection.scalars(select(Job.message_id).where(Job.id.in_(job_ids))))
