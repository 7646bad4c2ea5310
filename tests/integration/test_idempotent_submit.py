"""A caller-supplied idempotency key makes a submit safe to retry: one key, one job."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis
from sqlalchemy import func, select

from jobsvc import Client, InvalidJob
from jobsvc.routing.ledger import LoadLedger
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job

pytestmark = pytest.mark.integration

DOCUMENT = "The lighthouse keeper counted seven cats on the north pier. " * 20


def jobs_with_key(store: Store, key: str) -> int:
    with store.engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(Job).where(
            Job.idempotency_key == key)).scalar_one()


def test_a_retried_key_gets_the_same_job_and_records_nothing_new(
        routing_settings: Settings, store: Store) -> None:
    key = uuid.uuid4().hex
    with Client(settings=routing_settings) as client:
        first = client.submit_many([{"document": DOCUMENT, "question": "How many?",
                                     "idempotency_key": key},
                                    {"document": DOCUMENT, "question": "Where?"}])
        again = client.submit_many([{"document": DOCUMENT, "question": "How many?",
                                     "idempotency_key": key},
                                    {"document": DOCUMENT, "question": "Which pier?",
                                     "idempotency_key": key}])
        with pytest.raises(InvalidJob, match="idempotency_key"):
            client.submit_many([{"document": DOCUMENT, "question": "q",
                                 "idempotency_key": ""}])
    assert again == [first[0], first[0]]
    assert jobs_with_key(store, key) == 1


def test_two_submits_racing_with_one_key_make_one_job_and_leave_no_load_behind(
        routing_settings: Settings, store: Store) -> None:
    key = uuid.uuid4().hex
    clients = [Client(settings=routing_settings) for _ in range(2)]
    start = threading.Barrier(len(clients))
    ids: list[str] = []

    def submit(client: Client) -> None:
        start.wait()
        ids.extend(client.submit_many([{"document": DOCUMENT, "question": "Who?",
                                        "idempotency_key": key, "max_tokens": 8}]))

    threads = [threading.Thread(target=submit, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    assert len(ids) == 2 and ids[0] == ids[1]
    assert jobs_with_key(store, key) == 1
    # The shards carry the one job's charge: the loser returned its own.
    ledger = LoadLedger(redis.Redis.from_url(routing_settings.redis_url))
    with store.engine.connect() as connection:
        shard, load = connection.execute(select(Job.shard, Job.load).where(
            Job.id == ids[0])).one()
    assert {shard: charged for shard, charged in ledger.loads().items() if charged} == {
        shard: load}
