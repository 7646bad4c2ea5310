"""One fleet, several models, on private servers: two generative models of different shapes
(the first with a LoRA adapter) and an embedding model (the tiny model made a Matryoshka one),
each worker on its own shard. Lines and jobs run only on their own model's workers, through
`jobsvc serve` and the official `openai` client (strict) as through the Python API and
`jobsvc run-batch`; an adapter changes answers and leaves its base model's own; embeddings come
back one vector per input, cut to the dimensions asked. Then the only worker of one model dies
for good mid-burst: its jobs wait, no other model's worker runs them, and a new worker for that
model runs them all, once."""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from openai.types import CreateEmbeddingResponse
from sqlalchemy import select

from jobsvc import Client
from jobsvc.child_processes import LocalWorkers
from jobsvc.errors import InvalidJob
from jobsvc.health import read_heartbeat
from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.wire import JobStatus
from jobsvc.workloads import document_questions
from ops.build_tiny_lora import build as build_adapter
from tests.support.batch_files import file_lines, jsonl, line, results, start_batch, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_in_thread
from tests.support.environment import TEST_WORKER_NICE
from tests.support.fault_tally import kill_tree, tally
from tests.support.models import tiny_variant
from tests.support.servers import private_servers
from tests.support.vllm_batch import run_jobsvc_batch
from tests.support.waiting import until

pytestmark = pytest.mark.faults

EMBEDDINGS = "/v1/embeddings"
FINISH_TIMEOUT = 300
SHARD_TIMEOUT = 15
# The tiny model's hidden size: the length of its embeddings, and the lengths they may be cut to.
EMBEDDING_SIZE = 256
MATRYOSHKA = [64, 128, EMBEDDING_SIZE]
SHARD_A, SHARD_B, SHARD_EMBED, SHARD_B_AGAIN = 0, 1, 2, 3
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@dataclass
class ModelFleet:
    settings: dict[str, Settings]
    groups: dict[int, LocalWorkers]
    log_dir: Path
    client: Client

    def workers_of(self, job_ids: list[str]) -> dict[str, str | None]:
        """The worker that claimed each job, as the store says."""
        store = Store(self.client.settings.resolved_database_url)
        try:
            with store.engine.connect() as connection:
                return dict(connection.execute(  # type: ignore[arg-type]
                    select(Job.id, Job.worker).where(Job.id.in_(job_ids))).all())
        finally:
            store.dispose()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelFleet]:
    with private_servers(6423, 5473) as (redis_server, postgres):
        base = Settings.from_env(
            {}, redis_url=redis_server.url, database_url=postgres.url, shards=1,
            shard_timeout=SHARD_TIMEOUT, requeue_interval=2, stranded_grace=5, max_attempts=3,
            batch_size=4, worker_concurrency=2, visibility_timeout=8, metrics_port=0,
            worker_nice=TEST_WORKER_NICE, served_model_name="tiny-a")
        made = tmp_path_factory.mktemp("models")
        adapter = build_adapter(made / "tiny-sql")
        settings = {
            "tiny-a": replace(base, loras=f"tiny-sql={adapter}"),
            "tiny-b": replace(base, served_model_name="tiny-b", dtype="float32",
                              model=str(tiny_variant(made / "tiny-b", num_hidden_layers=2))),
            "tiny-embed": replace(
                base, served_model_name="tiny-embed", task="embed", dtype="float32",
                model=str(tiny_variant(made / "tiny-embed", matryoshka_dimensions=MATRYOSHKA))),
        }
        log_dir = Path(tmp_path_factory.mktemp("model-fleet-logs"))
        groups = {shard: LocalWorkers(settings[name], log_dir / name, shards=[shard],
                                      devices=[str(shard % 2)])
                  for shard, name in ((SHARD_A, "tiny-a"), (SHARD_B, "tiny-b"),
                                      (SHARD_EMBED, "tiny-embed"))}
        fleet = ModelFleet(settings, groups, log_dir, Client(settings=base))
        try:
            for group in groups.values():
                group.spawn()
            for group in groups.values():
                group.wait_ready()
            yield fleet
        finally:
            fleet.client.close()
            for group in fleet.groups.values():
                group.ask_to_stop()
            for group in fleet.groups.values():
                group.stop()


def _question(index: int, model: str) -> dict[str, object]:
    return {"model": model, "max_tokens": 4, "messages": [
        {"role": "user", "content": f"Question {index} for {model}: what is said here?"}]}


def test_each_models_lines_run_on_its_own_workers_and_an_unserved_model_fails_alone(
        fleet: ModelFleet) -> None:
    with server_in_thread(replace(fleet.client.settings, api_key=API_KEY)) as url:
        api = openai_client(url)
        listed = {model.id: model for model in api.models.list().data}
        assert set(listed) == {"tiny-a", "tiny-sql", "tiny-b", "tiny-embed"}
        assert (listed["tiny-sql"].model_extra or {})["parent"] == "tiny-a"
        models = ["tiny-a", "tiny-b", "tiny-sql"] * 2
        lines = [line(f"q{index}", _question(index, model))
                 for index, model in enumerate(models)]
        lines.append(line("unserved", _question(9, "tiny-c")))
        lines.append(line("embedder", _question(10, "tiny-embed")))
        batch = wait_for(api, start_batch(api, lines).id)
        vectors = wait_for(api, start_batch(api, [
            line("generator", {"model": "tiny-a", "input": "not an embedding model"},
                 EMBEDDINGS)], EMBEDDINGS).id)
        answers = {row["custom_id"]: row["response"]
                   for row in file_lines(api, batch.output_file_id)}
        errors = {row["custom_id"]: row["response"]["body"]["error"]
                  for row in file_lines(api, batch.error_file_id)}
        refused = {row["custom_id"]: row["response"]["body"]["error"]
                   for row in file_lines(api, vectors.error_file_id)}
    assert set(answers) == {f"q{index}" for index in range(len(models))}
    assert {custom_id: answer["body"]["model"] for custom_id, answer in answers.items()} == {
        f"q{index}": model for index, model in enumerate(models)}
    assert (errors["unserved"]["code"], errors["unserved"]["param"]) == ("model_not_found",
                                                                          "model")
    assert errors["embedder"]["param"] == "model"
    # Each line's job ran on the one worker serving its model (the adapter on its base's).
    jobs = {answer["request_id"].removeprefix("req_"): models[int(custom_id[1:])]
            for custom_id, answer in answers.items()}
    shard_of = {"tiny-a": SHARD_A, "tiny-sql": SHARD_A, "tiny-b": SHARD_B}
    assert {job_id: worker.split("@")[0] if worker else None
            for job_id, worker in fleet.workers_of(list(jobs)).items()} == {
        job_id: f"shard{shard_of[model]}" for job_id, model in jobs.items()}
    assert refused["generator"]["param"] == "model"


def test_the_python_api_names_models_and_refuses_one_the_fleet_never_served(
        fleet: ModelFleet) -> None:
    client = fleet.client
    text = "A short document the second model reads."
    job_b = client.submit(text, "What does it say?", max_tokens=3, model="tiny-b")
    with pytest.raises(InvalidJob) as unknown:
        client.submit(text, "?", max_tokens=3, model="tiny-c")
    assert unknown.value.field == "model"
    with pytest.raises(InvalidJob) as wrong_task:
        client.submit(text, "?", max_tokens=3, model="tiny-embed")
    assert wrong_task.value.field == "model"
    (answered,) = client.wait([job_b], timeout=FINISH_TIMEOUT)
    assert answered.status is JobStatus.SUCCEEDED and answered.model == "tiny-b"
    assert answered.shard == SHARD_B


def test_an_adapter_changes_answers_and_its_base_models_answers_stay_its_own(
        fleet: ModelFleet) -> None:
    """The same greedy question of the base model and of its adapter, in one message: the
    adapter's answer differs, and the base answer is the one it gives alone."""
    client = fleet.client
    text = "A ledger of orders, each with a customer, a date and an amount."
    both = client.wait(client.submit_many(
        {"document": text, "question": "Which customer ordered most?", "model": model, **GREEDY}
        for model in ("tiny-a", "tiny-sql")), timeout=FINISH_TIMEOUT)
    base, tuned = both
    assert {record.status for record in both} == {JobStatus.SUCCEEDED}
    assert {record.shard for record in both} == {SHARD_A}
    assert base.completion_tokens == tuned.completion_tokens == GREEDY["max_tokens"]
    assert tuned.answer != base.answer
    (alone,) = client.wait([client.submit(text, "Which customer ordered most?", model="tiny-a",
                                          **GREEDY)], timeout=FINISH_TIMEOUT)
    assert alone.answer == base.answer


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(value * value for value in vector))


def test_texts_embed_through_the_python_api(fleet: ModelFleet) -> None:
    client = fleet.client
    texts = ["the cat sat on the mat", "a different text", "the cat sat on the mat"]
    ids = client.submit_embeddings(texts, model="tiny-embed")
    cut_id, = client.submit_embeddings([texts[0]], dimensions=64, model="tiny-embed")
    records = client.wait([*ids, cut_id], timeout=FINISH_TIMEOUT)
    assert [record.status.value for record in records] == ["succeeded"] * 4, records
    tokens = PromptBuilder(fleet.settings["tiny-embed"].model).encode(texts, special=True)
    for record, expected in zip(records, tokens, strict=False):
        assert (record.answer, record.completion_tokens) == ("", 0)
        assert record.prompt_tokens == len(expected) and record.shard == SHARD_EMBED
        assert record.embeddings is not None and len(record.embeddings) == 1
        vector = record.embeddings[0]
        assert len(vector) == EMBEDDING_SIZE and math.isclose(_norm(vector), 1.0, rel_tol=1e-3)
    same, other, again, cut = (record.embeddings for record in records)
    assert same == again and same != other
    assert cut is not None and len(cut[0]) == 64
    for call, field in [
            (lambda: client.submit_embeddings(["fine", ""], model="tiny-embed"), "inputs[1]"),
            (lambda: client.submit_embeddings(["fine"], dimensions=96, model="tiny-embed"),
             "dimensions"),
            (lambda: client.submit_embeddings(["fine"], model="tiny-a"), "model"),
            (lambda: client.submit_embeddings(["fine"], model="no-such-model"), "model")]:
        with pytest.raises(InvalidJob) as refused:
            call()
        assert refused.value.field == field


def _floats(body: dict[str, Any]) -> list[list[float]]:
    """A float list's vectors, the body checked against the official client's model."""
    response = CreateEmbeddingResponse.model_validate(body)
    assert response.object == "list" and response.model == "tiny-embed"
    assert response.usage.total_tokens == response.usage.prompt_tokens
    return [item.embedding for item in response.data]


def test_an_embeddings_batch_answers_every_input_shape_and_a_bad_line_fails_alone(
        fleet: ModelFleet) -> None:
    def request(custom_id: str, **body: Any) -> dict[str, Any]:
        return line(custom_id, {"model": "tiny-embed", **body}, EMBEDDINGS)

    lines = [
        request("string", input="hello world"),
        request("list", input=["hello world", "second text"], user="someone"),
        request("tokens", input=[5, 6, 7, 8]),
        request("base64", input="hello world", encoding_format="base64"),
        request("cut", input="hello world", dimensions=128),
        request("bad-field", input="hello world", temperature=0),
        request("bad-dimensions", input="hello world", dimensions=96),
    ]
    with server_in_thread(replace(fleet.client.settings, api_key=API_KEY)) as url:
        api = openai_client(url)
        batch = wait_for(api, start_batch(api, lines, EMBEDDINGS).id, timeout=FINISH_TIMEOUT)
        assert batch.status == "completed" and batch.endpoint == EMBEDDINGS, batch
        output, errors = results(api, batch)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 2), errors
    bodies = {item["custom_id"]: item["response"]["body"] for item in output}
    assert list(bodies) == ["string", "list", "tokens", "base64", "cut"]
    string, = _floats(bodies["string"])
    listed = _floats(bodies["list"])
    tokens, = _floats(bodies["tokens"])
    cut, = _floats(bodies["cut"])
    assert [len(vector) for vector in (string, *listed, tokens, cut)] == [
        EMBEDDING_SIZE] * 4 + [128]
    assert listed[0] == string and listed[1] != string
    assert bodies["tokens"]["usage"]["prompt_tokens"] == 4
    prompt = len(PromptBuilder(fleet.settings["tiny-embed"].model).encode(
        ["hello world"], special=True)[0])
    assert bodies["string"]["usage"]["prompt_tokens"] == prompt
    encoded = bodies["base64"]["data"][0]["embedding"]
    assert list(struct.unpack(f"<{EMBEDDING_SIZE}f", base64.b64decode(encoded))) == string
    refusals = {item["custom_id"]: item["response"]["body"]["error"] for item in errors}
    assert (refusals["bad-field"]["param"], refusals["bad-field"]["code"]) == (
        "temperature", "unsupported_parameter")
    assert refusals["bad-dimensions"]["param"] == "dimensions"
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(body["usage"]["prompt_tokens"]
                                           for body in bodies.values())
    assert batch.usage.output_tokens == 0


# The fields of an embedding line's body as `vllm run-batch` (0.32) writes them, in its order.
VLLM_BODY = ["id", "object", "created", "model", "data", "usage"]
VLLM_USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "completion_tokens_details"]


def test_run_batch_writes_embedding_lines_as_vllm_run_batch_does(
        fleet: ModelFleet, tmp_path: Path) -> None:
    """Lines naming no model take the one the settings serve: here the embedding model."""
    requests = [line("string", {"input": "hello world"}, EMBEDDINGS),
                line("tokens", {"input": [5, 6, 7, 8]}, EMBEDDINGS),
                line("bad", {"input": []}, EMBEDDINGS)]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_bytes(jsonl(requests))
    run_jobsvc_batch(fleet.settings["tiny-embed"], input_path, output_path,
                     tmp_path / "run-batch.log", timeout=FINISH_TIMEOUT)
    written = [json.loads(raw) for raw in output_path.read_text().splitlines()]
    assert [item["custom_id"] for item in written] == ["string", "tokens", "bad"]
    for item in written[:2]:
        body = item["response"]["body"]
        assert list(body) == VLLM_BODY and list(body["usage"]) == VLLM_USAGE
        assert body["object"] == "list" and body["id"].startswith("embd-")
        assert body["model"] == "tiny-embed"
        assert [list(entry) for entry in body["data"]] == [["index", "object", "embedding"]]
        assert len(body["data"][0]["embedding"]) == EMBEDDING_SIZE
        assert body["usage"]["completion_tokens"] == 0
    assert written[1]["response"]["body"]["usage"]["prompt_tokens"] == 4
    assert written[2]["response"]["status_code"] == 400
    assert written[2]["error"]["error"]["param"] == "input"


def _burst(client: Client, model: str, documents: int, seed: int,
           max_tokens: int = 12) -> list[str]:
    work = document_questions(documents, 3, 120, seed=seed)
    return client.submit_many({"document": job.document, "question": job.question,
                               "max_tokens": max_tokens, "ignore_eos": True, "model": model}
                              for job in work)


def test_a_models_only_worker_killed_for_good_leaves_its_jobs_waiting_for_its_own_kind(
        fleet: ModelFleet) -> None:
    client = fleet.client
    worker = fleet.groups[SHARD_B].processes[0]
    ids_b = _burst(client, "tiny-b", 8, seed=402, max_tokens=32)
    # Frozen the moment its burst is out, then killed for good: it leaves messages in
    # flight and queued however fast this machine runs them.
    os.kill(worker.pid, signal.SIGSTOP)
    ids_a = _burst(client, "tiny-a", 4, seed=401)
    members = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
    kill_tree(members[0])
    worker.wait(timeout=30)
    assert not [member.pid for member in members if member.is_running()
                and member.status() != psutil.STATUS_ZOMBIE]
    row_a = tally(client, client.settings.resolved_database_url, "model A while B is dead",
                  ids_a, FINISH_TIMEOUT)
    assert row_a == {**row_a, "succeeded": len(ids_a), "lost": 0, "duplicated": 0}
    # Submitted while no worker serves tiny-b: known to the fleet, so taken, and waiting.
    later_b = _burst(client, "tiny-b", 2, seed=403)
    # Past the shard timeout and several reconciliation rounds, B's jobs still wait.
    broker = redis.Redis.from_url(client.settings.redis_url)
    until("tiny-b's shard counted dead and rounds run since",
          lambda: _silent_for(broker, SHARD_B) > SHARD_TIMEOUT + 4, FINISH_TIMEOUT, every=1)
    waiting = [record for record in map(client.get, [*ids_b, *later_b]) if not record.finished]
    assert waiting, "tiny-b's dead worker left nothing unfinished"
    assert {record.shard for record in waiting} == {SHARD_B}
    assert all(record.status is JobStatus.QUEUED or record.status is JobStatus.RUNNING
               for record in waiting)
    workers = fleet.workers_of([*ids_b, *later_b])
    assert not [worker for worker in workers.values()
                if worker is not None and not worker.startswith(f"shard{SHARD_B}@")]

    again = LocalWorkers(fleet.settings["tiny-b"], fleet.log_dir / "tiny-b-again",
                         shards=[SHARD_B_AGAIN], devices=["1"])
    fleet.groups[SHARD_B_AGAIN] = again
    again.start()
    row_b = tally(client, client.settings.resolved_database_url,
                  "model B's only worker killed, a new one joins", [*ids_b, *later_b],
                  FINISH_TIMEOUT)
    assert row_b == {**row_b, "succeeded": len(ids_b) + len(later_b), "lost": 0,
                     "duplicated": 0}
    ran = fleet.workers_of([*ids_b, *later_b])
    assert {worker.split("@")[0] for worker in ran.values() if worker} <= {
        f"shard{SHARD_B}", f"shard{SHARD_B_AGAIN}"}
    assert {client.get(job_id).shard for job_id in later_b} == {SHARD_B_AGAIN}


def _silent_for(broker: redis.Redis, shard: int) -> float:
    """Seconds since `shard`'s worker last wrote its heartbeat."""
    seen = read_heartbeat(broker, shard)
    assert seen is not None
    return seen.age_s
