"""Shard placement through the shared Redis state, with several producers at once."""

from __future__ import annotations

import random
import threading

import redis

from jobsvc import Client
from jobsvc.affinity import LOAD_KEY
from jobsvc.routing import queue_name
from jobsvc.workloads import document, question


def test_all_questions_on_a_document_go_to_one_shard_and_new_documents_spread(
        routing_settings) -> None:
    rng = random.Random(2)
    documents = [document(rng, 150) for _ in range(8)]
    with Client(settings=routing_settings) as client:
        ids = client.submit_many({"document": text, "question": question(rng)}
                                 for _ in range(3) for text in documents)
        records = [client.get(job_id) for job_id in ids]
    shards_of = {}
    for index, record in enumerate(records):
        shards_of.setdefault(documents[index % len(documents)], set()).add(record.shard)
    assert all(len(shards) == 1 for shards in shards_of.values())
    # Eight equal new documents over eight idle shards: the least-loaded rule spreads them.
    assert len({next(iter(shards)) for shards in shards_of.values()}) == 8
    broker = redis.Redis.from_url(routing_settings.redis_url)
    assert sum(broker.llen(queue_name(shard)) for shard in range(8)) >= 8
    assert all(int(value) > 0 for value in broker.hgetall(LOAD_KEY).values())


def test_racing_producers_agree_on_the_shard_of_a_new_document(routing_settings) -> None:
    rng = random.Random(4)
    texts = [document(rng, 60) for _ in range(12)]
    producers = [Client(settings=routing_settings) for _ in range(4)]
    for producer in producers:
        producer.submit("warm-up document for the tokenizer", "warm?")
    placed: dict[int, list[int]] = {index: [] for index in range(len(texts))}
    barrier = threading.Barrier(len(producers))

    def produce(producer: Client) -> None:
        for index, text in enumerate(texts):
            barrier.wait()
            job_id = producer.submit(text, "which shard?")
            placed[index].append(producer.get(job_id).shard)

    threads = [threading.Thread(target=produce, args=(p,)) for p in producers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for producer in producers:
        producer.close()
    assert all(len(shards) == len(producers) for shards in placed.values())
    assert all(len(set(shards)) == 1 for shards in placed.values()), placed
