"""Routing by model through Redis, with workers stood in for by their heartbeats and
registrations: jobs go only to shards serving their model, a model nothing ever served is
refused, and a model whose workers are gone keeps its jobs until a worker for it returns."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import redis
from sqlalchemy import select

from jobsvc import Client
from jobsvc.errors import InvalidJob
from jobsvc.health import KEEP_SECONDS, Heartbeat, write_heartbeat
from jobsvc.keys import heartbeat_key
from jobsvc.reconcile import Reconciler
from jobsvc.served_models import EMBED, GENERATE, ServedModel, register
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.transport import make_celery
from jobsvc.workloads import document, question

pytestmark = pytest.mark.integration


def _serve(client: redis.Redis, settings: Settings, shard: int, model: str, *,
           task: str = GENERATE, adapters: tuple[str, ...] = ()) -> None:
    """Shard `shard` heartbeats and registers as a worker serving `model` and `adapters`."""
    write_heartbeat(client, Heartbeat(
        shard=shard, worker=f"shard{shard}@test", host="test", pid=os.getpid(), up_s=1.0,
        engine_ready=True, messages_in_flight=0, last_message_finished_s=None, metrics_port=None,
        task=task, models=[model, *adapters]))
    served = ServedModel(model, task, settings.model, 4096)
    register(client, shard, [served, *(replace(served, name=name, base=model)
                                       for name in adapters)])


def _jobs(rng: random.Random, model: str, count: int) -> list[dict[str, object]]:
    text = document(rng, 150)
    return [{"document": text, "question": question(rng), "max_tokens": 4, "model": model}
            for _ in range(count)]


def test_jobs_go_only_to_the_shards_serving_their_model(routing_settings: Settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    _serve(broker, routing_settings, 0, "a", adapters=("a-sql",))
    _serve(broker, routing_settings, 2, "a")
    _serve(broker, routing_settings, 1, "b")
    _serve(broker, routing_settings, 3, "vectors", task=EMBED)
    rng = random.Random(11)
    with Client(settings=routing_settings) as client:
        ids = {model: client.submit_many([job for _ in range(4)
                                          for job in _jobs(rng, model, 3)])
               for model in ("a", "a-sql", "b")}
        shards = {model: {client.get(job_id).shard for job_id in job_ids}
                  for model, job_ids in ids.items()}
        assert {client.get(job_id).model for job_id in ids["a-sql"]} == {"a-sql"}
        with pytest.raises(InvalidJob) as unknown:
            client.submit("text", "?", model="c")
        with pytest.raises(InvalidJob) as wrong_task:
            client.submit("text", "?", model="vectors")
        with pytest.raises(InvalidJob) as no_default:
            client.submit("text", "?")
    assert shards["a"] <= {0, 2} and shards["a-sql"] == {0} and shards["b"] == {1}
    assert len(shards["a"]) == 2
    assert unknown.value.field == wrong_task.value.field == no_default.value.field == "model"
    assert "'c' is not served by this fleet" in str(unknown.value)


def test_a_models_jobs_wait_for_its_own_workers_and_move_once_one_returns(
        routing_settings: Settings, store: Store) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    settings = replace(routing_settings, shard_timeout=20)
    _serve(broker, settings, 0, "a")
    _serve(broker, settings, 1, "b")
    rng = random.Random(12)
    with Client(settings=settings) as client:
        first_b = client.submit_many(_jobs(rng, "b", 3))
        # Shard 1, b's only worker, has been silent for longer than the timeout.
        broker.expire(heartbeat_key(1), KEEP_SECONDS - settings.shard_timeout - 1)
        reconciler = Reconciler(settings, broker, store, make_celery(settings))
        reconciler.run_round()
        later_b = client.submit_many(_jobs(rng, "b", 3))
        ids_a = client.submit_many(_jobs(rng, "a", 3))
        reconciler.run_round()
        waiting = [client.get(job_id) for job_id in [*first_b, *later_b]]
        assert {record.shard for record in waiting} == {1}
        assert {record.status.value for record in waiting} == {"queued"}
        assert {client.get(job_id).shard for job_id in ids_a} == {0}
        # A worker that serves only a claims none of b's jobs from their own message.
        job_b = first_b[0]
        with store.engine.connect() as connection:
            message = connection.scalar(select(Job.message_id).where(Job.id == job_b))
        claim = store.claim_message([job_b], message_id=message, shard=1, redelivered=False,
                                    worker="w", max_attempts=3, models=["a"])
        assert claim.jobs == []
        claim = store.claim_message([job_b], message_id=message, shard=1, redelivered=False,
                                    worker="w", max_attempts=3, models=["b"])
        assert [job.model for job in claim.jobs] == ["b"]
        # A worker for b joins under another shard number: the next round moves b's jobs.
        _serve(broker, settings, 4, "b")
        reconciler.run_round()
        moved = [client.get(job_id) for job_id in [*first_b, *later_b]]
    assert {record.shard for record in moved} == {4}
    assert {record.status.value for record in moved} == {"queued"}
