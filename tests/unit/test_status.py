"""`jobsvc status` from a fleet's state: which shards are listed, what a heartbeat says, the
report's shape, and the exit code a health check reads."""

from __future__ import annotations

import json

import pytest

from jobsvc.fleet import Fleet, ShardView, listed_shards
from jobsvc.health import ALIVE_SECONDS, Heartbeat, HeartbeatError, SeenWorker
from jobsvc.keys import heartbeat_key, queue_name, shard_of_heartbeat, shard_of_queue
from jobsvc.status import (
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    exit_code,
    render_text,
    status_report,
)

pytestmark = pytest.mark.unit


def beat(shard: int = 0, *, engine_ready: bool = True, stopped: bool = False,
         last_message: float | None = 2.0) -> Heartbeat:
    return Heartbeat(shard=shard, worker=f"shard{shard}@host", host="host", pid=41,
                     up_s=90.0, engine_ready=engine_ready, messages_in_flight=1,
                     last_message_finished_s=last_message, metrics_port=9400 + shard,
                     stopped=stopped)


def view(shard: int, *, messages: int = 0, queued: int = 0, running: int = 0,
         worker: SeenWorker | None = None, configured: bool = True) -> ShardView:
    return ShardView(shard, configured, messages, {"queued": queued, "running": running},
                     100 * queued, worker)


def test_a_heartbeat_round_trips_through_json_and_refuses_other_versions() -> None:
    heartbeat = beat(3)
    assert Heartbeat.from_json(heartbeat.to_json()) == heartbeat
    record = json.loads(heartbeat.to_json())
    with pytest.raises(HeartbeatError, match="version"):
        Heartbeat.from_json(json.dumps({**record, "v": 99}))
    with pytest.raises(HeartbeatError, match="not JSON"):
        Heartbeat.from_json(b"\x80garbage")
    del record["pid"]
    with pytest.raises(HeartbeatError, match="pid"):
        Heartbeat.from_json(json.dumps(record))


def test_a_worker_is_alive_while_its_heartbeats_are_fresh_and_healthy_once_its_engine_is_ready(
        ) -> None:
    assert SeenWorker(beat(), 1.0).healthy
    assert not SeenWorker(beat(engine_ready=False), 1.0).healthy
    assert SeenWorker(beat(engine_ready=False), 1.0).alive
    assert not SeenWorker(beat(), ALIVE_SECONDS + 1).alive
    assert not SeenWorker(beat(stopped=True), 0.0).alive


def test_shard_keys_name_their_shard_and_nothing_else_does() -> None:
    assert shard_of_queue(queue_name(12)) == 12
    assert shard_of_heartbeat(heartbeat_key(3)) == 3
    assert shard_of_queue("jobs.shard.1\x06\x163") is None
    assert shard_of_queue(heartbeat_key(3)) is None
    assert shard_of_heartbeat(queue_name(3)) is None


def test_the_configured_shards_and_every_live_one_are_listed_once_in_order() -> None:
    assert listed_shards(2, {5}, {1: "jobs"}, set()) == [0, 1, 5]
    assert listed_shards(1) == [0]


def test_the_report_has_a_row_per_shard_with_its_queue_jobs_and_worker() -> None:
    fleet = Fleet([view(0, running=4, worker=SeenWorker(beat(0), 1.5)),
                   view(3, messages=2, queued=64, configured=False)], batches=None)
    report = status_report(fleet)
    first, second = report["shards"]
    assert first["shard"] == 0 and first["jobs"] == {"queued": 0, "running": 4}
    assert first["worker"]["alive"] and first["worker"]["host"] == "host"
    assert first["worker"]["last_seen_s"] == 1.5
    # Seconds before the heartbeat plus the heartbeat's age: seconds ago when read.
    assert first["worker"]["last_message_finished_s"] == 3.5
    assert first["worker"]["metrics_port"] == 9400
    assert second == {"shard": 3, "configured": False, "queue_messages": 2,
                      "jobs": {"queued": 64, "running": 0}, "outstanding_load": 6400,
                      "worker": {"alive": False, "last_seen_s": None},
                      "needs_attention": True}
    assert "batches" not in report
    assert json.loads(json.dumps(report)) == report


def test_work_without_a_healthy_worker_fails_the_exit_code_and_idle_shards_do_not() -> None:
    healthy = SeenWorker(beat(), 1.0)
    assert exit_code(Fleet([view(0, queued=5, worker=healthy), view(1)], None)) == EXIT_HEALTHY
    assert exit_code(Fleet([view(0, messages=1)], None)) == EXIT_UNHEALTHY
    assert exit_code(Fleet([view(0, running=1, worker=SeenWorker(beat(), 60.0))],
                           None)) == EXIT_UNHEALTHY
    starting = SeenWorker(beat(engine_ready=False), 1.0)
    assert exit_code(Fleet([view(0, queued=1, worker=starting)], None)) == EXIT_UNHEALTHY


def test_a_shard_asked_about_alone_needs_a_healthy_worker_even_when_idle() -> None:
    assert exit_code(Fleet([view(2)], None), named=True) == EXIT_UNHEALTHY
    assert exit_code(Fleet([view(2, worker=SeenWorker(beat(2), 1.0))], None),
                     named=True) == EXIT_HEALTHY


def test_the_text_shows_each_worker_and_names_the_shards_that_need_attention() -> None:
    fleet = Fleet([view(0, worker=SeenWorker(beat(0), 2.0)),
                   view(1, queued=3, worker=SeenWorker(beat(1, stopped=True), 40.0)),
                   view(7, messages=1, configured=False)], batches={"in_progress": 2})
    lines = render_text(status_report(fleet)).splitlines()
    assert lines[0].split() == ["shard", "queue", "queued", "running", "load", "worker"]
    assert lines[1].startswith("0 ") and "alive shard0@host pid 41, engine ready" in lines[1]
    assert "last message 4 s ago" in lines[1]
    assert "stopped (shard1@host, seen 40 s ago)" in lines[2]
    assert lines[3].startswith("7*") and lines[3].endswith("none seen")
    assert lines[-3].startswith("* live")
    assert lines[-2] == "batches: in_progress 2"
    assert lines[-1].startswith("needs attention: shard 1, 7")
