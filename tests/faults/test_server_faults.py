"""`jobsvc serve` when a client or the database fails it: a file deleted during its download
fails the client's read (never a short 200), a storm of stalled uploads holds no database
connection and ends in 408s while other clients are served, and a PostgreSQL outage answers
503 with Retry-After until the database is back. Each scenario records a row of the fault
table: requests made, answered whole, refused visibly, and lost (answered wrongly) or kept
twice."""

from __future__ import annotations

import io
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import openai
import psutil
import pytest
import redis

from jobsvc.child_processes import ServerProcess
from jobsvc.settings import Settings
from tests.support.batch_server import API_KEY, openai_client, server_process
from tests.support.environment import (
    FAULT_TABLE,
    TEST_DATABASE,
    WORKER_REDIS_URL,
    recreate_database,
)
from tests.support.raw_http import connect, head, read_reply
from tests.support.servers import private_servers
from tests.support.waiting import until

pytestmark = pytest.mark.faults

READ_TIMEOUT = 4
STALLED = 20
# What 20 stalled uploads may leave the server holding: their spools' first chunks at most.
STALLED_RSS_BOUND = 80 << 20
# Served "promptly" while the stalled uploads wait: far below any pool or read timeout.
PROMPT_SECONDS = 3
BOUNDARY = "faults-test-boundary"


def record(scenario: str, *, submitted: int, succeeded: int, failed: int, lost: int,
           duplicated: int) -> None:
    """A row of the fault table, in the columns `tests.support.fault_tally.tally` gives jobs."""
    FAULT_TABLE.append({"scenario": scenario, "submitted": submitted, "succeeded": succeeded,
                        "failed": failed, "cancelled": 0, "lost": lost,
                        "duplicated": duplicated})


@pytest.fixture(scope="module")
def serve_settings() -> Settings:
    """A database and a Redis database of this module's own: it runs in a process beside the
    session's shared worker, whose database and Redis it must leave alone."""
    redis_url = WORKER_REDIS_URL.rsplit("/", 1)[0] + "/13"
    redis.Redis.from_url(redis_url).flushdb()
    return Settings.from_env({}, redis_url=redis_url,
                             database_url=recreate_database(f"{TEST_DATABASE}_serve"))


@pytest.fixture(scope="module")
def server(serve_settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    served = server_process(replace(serve_settings, api_key=API_KEY, max_upload_bytes=64 << 20,
                                    body_read_timeout=READ_TIMEOUT),
                            tmp_path_factory.mktemp("server-faults") / "serve.log")
    served.start()
    yield served
    served.stop()


def test_a_file_deleted_during_its_download_fails_the_clients_read(
        server: ServerProcess) -> None:
    api = openai_client(server.url)
    size = 32 << 20
    data = random.Random(5).randbytes(size)
    file_id = api.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch").id
    received = bytearray()
    # The client's own transport error (the official client's HTTP library) for a body
    # that stops short of its Content-Length.
    with pytest.raises(Exception, match="without sending complete message body"), \
            api.files.with_streaming_response.content(file_id) as response:
        assert int(response.headers["content-length"]) == size
        pieces = response.iter_bytes(1 << 20)
        received += next(pieces)
        assert openai_client(server.url).files.delete(file_id).deleted
        for piece in pieces:
            received += piece
    assert 0 < len(received) < size and bytes(received) == data[:len(received)]
    record("file deleted mid-download", submitted=1, succeeded=0, failed=1,
           lost=int(len(received) == size), duplicated=0)


def stall_upload(port: int) -> socket.socket:
    """An upload that sends its head and the start of its file, then nothing more."""
    start = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
             f"batch\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
             f"filename=\"stalled.jsonl\"\r\n\r\n").encode() + b'{"x": 1}\n' * 6000
    connection = connect(port, timeout=READ_TIMEOUT + 30)
    connection.sendall(head("POST", "/v1/files", headers={
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        "Content-Length": str(10 << 20)}) + start)
    return connection


def test_stalled_uploads_take_no_connection_and_end_in_408_while_others_are_served(
        server: ServerProcess) -> None:
    api = openai_client(server.url)
    files_before = {item.id for item in api.files.list()}
    before = int(psutil.Process(server.pid).memory_info().rss)
    stalled = [stall_upload(server.port) for _ in range(STALLED)]
    try:
        started = time.monotonic()
        listed = api.files.list()
        uploaded = openai_client(server.url).files.create(
            file=("ok.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
        api.batches.list()
        assert time.monotonic() - started < PROMPT_SECONDS
        assert {item.id for item in listed} == files_before
        assert psutil.Process(server.pid).memory_info().rss - before < STALLED_RSS_BOUND
        replies = [read_reply(connection) for connection in stalled]
    finally:
        for connection in stalled:
            connection.close()
    assert [reply.status for reply in replies] == [408] * STALLED
    assert {reply.error()["code"] for reply in replies} == {"request_timeout"}
    files_after = {item.id for item in api.files.list()}
    assert files_after - files_before == {uploaded.id}
    record("stalled uploads", submitted=STALLED + 1, succeeded=1, failed=STALLED,
           lost=int(uploaded.id not in files_after),
           duplicated=len(files_after - files_before) - 1)


def test_a_postgresql_outage_answers_503_with_retry_after_until_it_is_back(
        serve_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> None:
    with private_servers(6403, 5453) as (redis_server, postgres):
        served = server_process(replace(serve_settings, api_key=API_KEY, redis_url=redis_server.url,
                                        database_url=postgres.url),
                                tmp_path_factory.mktemp("outage") / "serve.log")
        served.start()
        try:
            api = openai_client(served.url)
            kept = api.files.create(file=("a.jsonl", io.BytesIO(b'{"a": 1}\n')),
                                    purpose="batch")
            postgres.stop()
            try:
                calls = [lambda: api.files.retrieve(kept.id), lambda: api.files.list(),
                         lambda: api.files.content(kept.id), lambda: api.batches.list(),
                         lambda: api.batches.retrieve("batch_x"),
                         lambda: api.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")),
                                                  purpose="batch")]
                refusals = []
                for call in calls:
                    with pytest.raises(openai.InternalServerError) as refused:
                        call()
                    refusals.append(refused.value)
                assert [error.status_code for error in refusals] == [503] * len(calls)
                assert {error.response.headers["retry-after"] for error in refusals} == {"5"}
                assert {error.body["code"] for error in refusals} == {"service_unavailable"}
                with connect(served.port) as connection:
                    for _ in range(2):  # the connection outlives its 503
                        connection.sendall(head("GET", f"/v1/files/{kept.id}"))
                        assert read_reply(connection).status == 503
            finally:
                postgres.start()
            back = until("the server reads the database again",
                         lambda: api.files.retrieve(kept.id),
                         ignoring=(openai.InternalServerError,))
            assert back.id == kept.id and api.files.content(kept.id).read() == b'{"a": 1}\n'
            names = sorted(item.filename for item in api.files.list())
        finally:
            served.stop()
    assert names == ["a.jsonl"]
    record("PostgreSQL down under the server", submitted=len(calls), succeeded=0,
           failed=len(refusals), lost=0, duplicated=len(names) - 1)
