"""What the real router costs per submit on a large fleet: Redis round trips, bytes each way,
the producer's CPU and the Redis server's, per policy, measured on a private Redis server so
nothing else is counted. The fleet is made of live heartbeats (no engines): routing needs only
what workers write to Redis.

Run: `python -m jobsvc.bench.routercost [--shards 64] [--submits 500]`; prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import redis

from jobsvc.health import Heartbeat, write_heartbeat
from jobsvc.private_redis import PrivateRedis
from jobsvc.routing.job_cost import RoutingJob, decode_load
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.live import LiveShards
from jobsvc.routing.policies import POLICY_NAMES
from jobsvc.routing.prefix import document_keys
from jobsvc.routing.router import make_router
from jobsvc.settings import Settings


class _CountingConnection(redis.Connection):
    """Counts what the client sends: each send is one round trip (a pipeline sends once)."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def _server_totals(client: redis.Redis) -> tuple[int, int, float]:
    stats, cpu = client.info("stats"), client.info("cpu")
    return (int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]),
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


_DOCUMENTS_PER_SUBMIT = 4
_QUESTIONS_PER_DOCUMENT = 4


def _submits(rng: random.Random, documents: list[tuple[int, ...]], count: int,
             settings: Settings) -> list[list[RoutingJob]]:
    """Submits of _DOCUMENTS_PER_SUBMIT documents x _QUESTIONS_PER_DOCUMENT questions, drawn
    from a pool the fleet has mostly seen."""
    keys = [document_keys(tokens, settings.block_size) for tokens in documents]
    decode = decode_load(16, settings.routing_decode_cost)
    return [[RoutingJob(keys[index], len(documents[index]) + 20, decode)
             for index in rng.sample(range(len(keys)), _DOCUMENTS_PER_SUBMIT)
             for _ in range(_QUESTIONS_PER_DOCUMENT)]
            for _ in range(count)]


def measure(shards: int, submits: int, policy: str) -> dict[str, Any]:
    """Route `submits` submits over `shards` heartbeating shards with `policy` on a private Redis,
    after a warm-up, and count round trips, bytes and CPU per submit."""
    with PrivateRedis() as server:
        pool = redis.ConnectionPool.from_url(server.url, connection_class=_CountingConnection)
        client = redis.Redis(connection_pool=pool)
        settings = Settings.from_env({}, redis_url=server.url, shards=shards, routing=policy)
        for shard in range(shards):
            write_heartbeat(client, Heartbeat(
                shard=shard, worker=f"shard{shard}@bench", host="bench", pid=os.getpid(),
                up_s=1.0, engine_ready=True, messages_in_flight=0, last_message_finished_s=None,
                metrics_port=None, task=settings.task, models=[settings.served_model_name]))
        rng = random.Random(shards)
        documents = [tuple(rng.randrange(4000) for _ in range(1500)) for _ in range(1024)]
        router = make_router(client, LoadLedger(client), settings)
        for jobs in _submits(rng, documents, 300, settings):
            router.route(jobs)
        measured = _submits(rng, documents, submits, settings)
        with _Counted(client) as counted:
            for jobs in measured:
                router.route(jobs)
        with _Counted(client) as live_read:
            live = LiveShards(client, shards).shards(settings.served_model_name).shards
        if len(live) != shards:
            raise RuntimeError(f"{len(live)} of the {shards} shards read as live")
        return {"policy": policy, "shards": shards,
                "jobs_per_submit": _DOCUMENTS_PER_SUBMIT * _QUESTIONS_PER_DOCUMENT,
                "per_submit": counted.per(submits),
                # At most once per LIVE_SET_SECONDS per producer.
                "live_set_read": live_read.per(1)}


class _Counted:
    """Round trips, bytes each way and CPU of both sides over a block of work; what reading
    the server's counters itself adds is measured once and taken off."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def __enter__(self) -> _Counted:
        first = _server_totals(self._client)
        self._server = _server_totals(self._client)
        self._reading = [after - before for before, after in zip(first, self._server,
                                                                 strict=True)]
        self._sends = _CountingConnection.sends
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.cpu, self.wall = time.process_time() - self._cpu, time.perf_counter() - self._wall
        self.round_trips = _CountingConnection.sends - self._sends
        after = _server_totals(self._client)
        self.sent, self.received, self.server_cpu = (
            after[index] - self._server[index] - self._reading[index] for index in range(3))

    def per(self, count: int) -> dict[str, float]:
        return {"round_trips": self.round_trips / count,
                "bytes_to_redis": round(self.sent / count),
                "bytes_from_redis": round(self.received / count),
                "producer_cpu_ms": round(1000 * self.cpu / count, 3),
                "redis_cpu_ms": round(1000 * self.server_cpu / count, 3),
                "wall_ms": round(1000 * self.wall / count, 3)}


def main() -> None:
    """`python -m jobsvc.bench.routercost`: the cost of each policy asked for (all by default),
    as JSON."""
    parser = argparse.ArgumentParser(prog="python -m jobsvc.bench.routercost", description=__doc__)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--submits", type=int, default=500)
    parser.add_argument("--policy", choices=POLICY_NAMES, action="append")
    args = parser.parse_args()
    print(json.dumps([measure(args.shards, args.submits, policy)
                      for policy in args.policy or POLICY_NAMES], indent=2))


if __name__ == "__main__":
    main()
