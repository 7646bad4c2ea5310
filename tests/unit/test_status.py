"""`jobsvc status` from a fleet's state: which shards are listed, what a heartbeat says, the
report's shape, and the exit code a health check reads."""

from __future__ import annotations

import json

import pytest

from jobsvc.fleet import Fleet, ModelView, ShardView, listed_shards, model_views, served_names
from jobsvc.health import ALIVE_SECONDS, Heartbeat, HeartbeatError, SeenWorker
from jobsvc.keys import heartbeat_key, queue_name, shard_of_heartbeat, shard_of_queue
from jobsvc.served_models import ServedModel
from jobsvc.status import (
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    exit_code,
    render_text,
    status_report,
)

pytestmark = pytest.mark.unit


def beat(shard: int = 0, *, engine_ready: bool = True, stopped: bool = False,
         last_message: float | None = 2.0, task: str = "generate",
         models: tuple[str, ...] = ("jobsvc",)) -> Heartbeat:
    return Heartbeat(shard=shard, worker=f"shard{shard}@host", host="host", pid=41,
                     up_s=90.0, engine_ready=engine_ready, messages_in_flight=1,
                     last_message_finished_s=last_message, metrics_port=9400 + shard,
                     task=task, models=list(models), stopped=stopped)


def view(shard: int, *, messages: int = 0, queued: int = 0, running: int = 0,
         worker: SeenWorker | None = None, configured: bool = True,
         models: tuple[str, ...] = ()) -> ShardView:
    return ShardView(shard, configured, messages, {"queued": queued, "running": running},
                     100 * queued, worker, list(models))


def model(name: str, *, workers: int = 1, queued: int = 0, running: int = 0,
          task: str | None = "generate") -> ModelView:
    return ModelView(name, task, workers, {"queued": queued, "running": running})


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
    assert second == {"shard": 3, "configured": False, "models": [], "queue_messages": 2,
                      "jobs": {"queued": 64, "running": 0}, "outstanding_load": 6400,
                      "worker": {"alive": False, "last_seen_s": None},
                      "needs_attention": True}
    assert "batches" not in report and report["models"] == []
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
    assert lines[0].split() == ["shard", "model", "queue", "queued", "running", "load",
                                "worker"]
    assert lines[1].startswith("0 ") and "alive shard0@host pid 41, engine ready" in lines[1]
    assert "last message 4 s ago" in lines[1]
    assert "stopped (shard1@host, seen 40 s ago)" in lines[2]
    assert lines[3].startswith("7*") and lines[3].endswith("none seen")
    assert lines[-3].startswith("* live")
    assert lines[-2] == "batches: in_progress 2"
    assert lines[-1].startswith("needs attention: shard 1, 7")


def test_a_shard_serves_what_its_heartbeat_names_or_else_what_it_registered_last() -> None:
    assert served_names(SeenWorker(beat(models=("base", "sql")), 1.0), ["old"]) == ["base", "sql"]
    assert served_names(None, ["old", "sql"]) == ["old", "sql"]
    assert served_names(None, []) == []


def test_every_registered_served_or_asked_for_model_is_listed_with_its_live_workers() -> None:
    workers = {0: SeenWorker(beat(0, models=("base", "sql")), 1.0),
               1: SeenWorker(beat(1, models=("base",), engine_ready=False), 1.0),
               2: SeenWorker(beat(2, models=("embedder",)), 60.0),
               3: SeenWorker(beat(3, task="embed", models=("starting",)), 1.0)}
    shards = [view(shard, worker=seen, models=tuple(seen.heartbeat.models))
              for shard, seen in workers.items()]
    registered = {name: ServedModel(name, task, "weights", 512)
                  for name, task in (("base", "generate"), ("sql", "generate"),
                                     ("embedder", "embed"), ("retired", "generate"))}
    active = {"sql": {"running": 3}, "embedder": {"queued": 5}, "unknown": {"queued": 1}}
    views = {view.name: view for view in model_views(shards, workers, active, registered)}
    assert list(views) == ["base", "embedder", "retired", "sql", "starting", "unknown"]
    # Alive counts, ready or not; a gone heartbeat does not.
    assert views["base"] == model("base", workers=2)
    assert views["sql"] == model("sql", running=3)
    assert views["embedder"] == model("embedder", workers=0, queued=5, task="embed")
    assert views["embedder"].waiting and views["unknown"].waiting
    assert not views["retired"].waiting and not views["sql"].waiting
    # Not registered yet: the heartbeat says what it does; nothing says for jobs alone.
    assert views["starting"].task == "embed" and views["unknown"].task is None
    one_shard = model_views(shards[:1], workers, {"other": {"queued": 2}}, registered,
                            every_registered=False)
    assert [view.name for view in one_shard] == ["base", "other", "sql"]


def test_jobs_no_live_worker_serves_fail_the_exit_code_unless_one_shard_is_asked_about() -> None:
    healthy = SeenWorker(beat(), 1.0)
    shards = [view(0, queued=5, worker=healthy, models=("jobsvc",))]
    assert exit_code(Fleet(shards, None, [model("jobsvc", queued=5),
                                          model("retired", workers=0)])) == EXIT_HEALTHY
    waiting = Fleet(shards, None, [model("jobsvc", queued=5), model("sql", workers=0, queued=2)])
    assert exit_code(waiting) == EXIT_UNHEALTHY
    # The worker's own health check: another model's waiting jobs are not its fault.
    assert exit_code(waiting, named=True) == EXIT_HEALTHY
    report = status_report(waiting, named=True)
    assert report["models"][1] == {"model": "sql", "task": "generate", "workers": 0,
                                   "jobs": {"queued": 2, "running": 0}, "waiting": True,
                                   "needs_attention": False}


def test_the_text_shows_each_shards_model_and_a_table_of_models_naming_those_that_wait(
        ) -> None:
    fleet = Fleet([view(0, queued=4, worker=SeenWorker(beat(0, models=("base", "sql")), 2.0),
                        models=("base", "sql")),
                   view(1, queued=2, models=("chat",))], batches=None,
                  models=[model("base", running=4), model("chat", workers=0, queued=2),
                          model("sql")])
    report = status_report(fleet)
    assert report["shards"][0]["models"] == ["base", "sql"]
    assert [entry["model"] for entry in report["models"]] == ["base", "chat", "sql"]
    lines = render_text(report).splitlines()
    assert lines[0].split() == ["shard", "model", "queue", "queued", "running", "load",
                                "worker"]
    assert lines[1].split()[:2] == ["0", "base+sql"] and lines[2].split()[:2] == ["1", "chat"]
    assert lines[3].split() == ["model", "task", "workers", "queued", "running"]
    assert lines[4].split() == ["base", "generate", "1", "0", "4"]
    assert lines[5].split() == ["chat", "generate", "0", "2", "0", "jobs", "wait", "for", "a",
                                "worker"]
    assert lines[6].split() == ["sql", "generate", "1", "0", "0"]
    assert lines[-1] == ("needs attention: shard 1 (work waits, no healthy worker); model chat "
                         "(jobs wait, no live worker serves it)")
    healthy = Fleet([view(0, worker=SeenWorker(beat(0), 2.0), models=("jobsvc",))], None,
                    [model("jobsvc")])
    assert render_text(status_report(healthy)).splitlines()[-1].startswith("ok: ")
