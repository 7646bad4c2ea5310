"""What one client's request can cost `jobsvc serve`: its key is checked before its body is
read, every body has a cap (the upload limit for uploads, a small one for JSON), a form's
fields are counted and capped, a multipart body must be whole, and text PostgreSQL cannot
store is refused naming its parameter, with the connection still good for the next request.
Measured on a real `jobsvc serve` child (its RSS) with the official client and raw sockets."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import openai
import psutil
import pytest

from jobsvc.child_processes import ServerProcess
from jobsvc.settings import Settings
from tests.support.batch_server import API_KEY, openai_client, server_process
from tests.support.raw_http import chunked, connect, exchange, head, read_reply

pytestmark = pytest.mark.integration

UPLOAD_LIMIT = 4 << 20
# What a refused request may leave the server holding: a few buffers, never its body.
RSS_BOUND = 40 << 20
BOUNDARY = "bounds-test-boundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


@pytest.fixture(scope="module")
def server(settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    served = server_process(replace(settings, api_key=API_KEY, max_upload_bytes=UPLOAD_LIMIT),
                            tmp_path_factory.mktemp("bounds") / "serve.log")
    served.start()
    yield served
    served.stop()


@pytest.fixture()
def api(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server.url)


def rss(server: ServerProcess) -> int:
    return int(psutil.Process(server.pid).memory_info().rss)


def zeros(total: int, piece: int = 1 << 20) -> Iterator[bytes]:
    block = b"0" * piece
    for _ in range(total // piece):
        yield block


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (
        "" if filename is None else f'; filename="{filename}"')
    return (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n").encode() + (
        value + b"\r\n")


def closing() -> bytes:
    return f"--{BOUNDARY}--\r\n".encode()


def file_count(api: openai.OpenAI) -> int:
    return len(api.files.list().data)


def test_an_unauthenticated_body_is_refused_before_it_is_read(server: ServerProcess) -> None:
    size = 150_000_000
    before = rss(server)
    reply, sent = exchange(server.port, head(
        "POST", "/v1/batches", key=None,
        headers={"Content-Type": "application/json", "Content-Length": str(size)}),
        zeros(size))
    assert reply.status == 401 and reply.error()["code"] == "invalid_api_key"
    assert sent < size
    assert rss(server) - before < RSS_BOUND


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_json_body_past_its_cap_is_refused_without_being_held(
        server: ServerProcess, declared: bool) -> None:
    size = 150_000_000
    before = rss(server)
    if declared:
        headers, body = {"Content-Length": str(size)}, zeros(size)
    else:
        headers, body = {"Transfer-Encoding": "chunked"}, chunked(zeros(size))
    reply, sent = exchange(server.port, head(
        "POST", "/v1/batches", headers={"Content-Type": "application/json", **headers}), body)
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    assert sent < size
    assert rss(server) - before < RSS_BOUND


def test_the_official_client_sending_a_huge_batch_request_gets_413(api: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        api.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions",
                           completion_window="24h", extra_body={"pad": "x" * (8 << 20)})
    assert refused.value.status_code == 413


def test_form_fields_are_counted_and_capped_and_never_held(
        server: ServerProcess, api: openai.OpenAI) -> None:
    files_before = file_count(api)
    before = rss(server)
    many = 150_000
    field = part("extra", b"f" * 1000)
    # Chunked, so that no declared length gives the flood away before its fields are read.
    reply, sent = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Transfer-Encoding": "chunked"}),
        chunked(field for _ in range(many)))
    assert reply.status == 400 and reply.error()["code"] == "too_many_fields"
    assert sent < len(field) * many
    long_field = part("purpose", b"b" * (1 << 20)) + part("file", b"{}\n", "a.jsonl")
    reply, _ = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Content-Length": str(len(long_field))}), [long_field])
    assert reply.status == 400 and reply.error()["param"] == "purpose"
    assert rss(server) - before < RSS_BOUND
    assert file_count(api) == files_before


def test_a_request_past_the_upload_limit_counts_its_fields_too(server: ServerProcess) -> None:
    # Each field and part header is short, the file within the limit: the whole request is
    # not.
    padding = "".join(f"X-Pad-{index}: {'p' * 4000}\r\n" for index in range(7))
    padded = b"".join(part(f"f{index}", b"v" * 1000).replace(
        b"\r\n\r\n", f"\r\n{padding}\r\n".encode(), 1) for index in range(6))
    body = padded + part("purpose", b"batch") + part(
        "file", b"x" * (UPLOAD_LIMIT - 1000), "a.jsonl") + closing()
    reply, _ = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Transfer-Encoding": "chunked"}), chunked([body]))
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"


def test_a_truncated_upload_is_refused_and_nothing_is_kept(
        server: ServerProcess, api: openai.OpenAI) -> None:
    files_before = file_count(api)
    lines = b"".join(b'{"custom_id": "%d"}\n' % index for index in range(50_000))
    cut = part("purpose", b"batch") + part("file", lines, "a.jsonl")[:-len(lines) // 2]
    reply, _ = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Content-Length": str(len(cut))}), [cut])
    assert reply.status == 400 and reply.error()["param"] == "file"
    assert reply.error()["code"] == "incomplete_upload"
    assert file_count(api) == files_before
    whole = part("purpose", b"batch") + part("file", lines, "a.jsonl") + closing()
    reply, _ = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Content-Length": str(len(whole))}), [whole])
    assert reply.status == 200
    assert api.files.content(reply.body.decode().split('"id":"')[1].split('"')[0]
                             ).read() == lines


@pytest.mark.parametrize("body", [
    b"\x00\xff garbage \r\n\r\n--",
    f"--{BOUNDARY}\r\nno colon here\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode(),
    f"--{BOUNDARY}X\r\n\r\n".encode(),
], ids=["binary", "bad-part-header", "bad-boundary"])
def test_garbage_multipart_is_a_400_naming_the_file(server: ServerProcess, body: bytes) -> None:
    reply, _ = exchange(server.port, head(
        "POST", "/v1/files", headers={"Content-Type": MULTIPART,
                                      "Content-Length": str(len(body))}), [body])
    assert reply.status == 400 and reply.error()["param"] == "file"


@pytest.mark.parametrize(("method", "target", "param"), [
    ("GET", "/v1/files/file-" + quote("\x00"), "file_id"),
    ("GET", "/v1/files/file-" + quote("\x00") + "/content", "file_id"),
    ("DELETE", "/v1/files/file-" + quote("\x00"), "file_id"),
    ("GET", "/v1/batches/batch_" + quote("\x00"), "batch_id"),
    ("POST", "/v1/batches/batch_" + quote("\x00") + "/cancel", "batch_id"),
    ("GET", "/v1/files?after=" + quote("a\x00"), "after"),
    ("GET", "/v1/files?purpose=" + quote("\x00"), "purpose"),
    ("GET", "/v1/batches?after=" + quote("\x00"), "after"),
])
def test_a_nul_in_a_parameter_is_a_400_naming_it_and_the_connection_lives_on(
        server: ServerProcess, method: str, target: str, param: str) -> None:
    with connect(server.port) as connection:
        connection.sendall(head(method, target))
        refused = read_reply(connection)
        assert refused.status == 400 and refused.error()["param"] == param
        connection.sendall(head("GET", "/v1/models"))
        assert read_reply(connection).status == 200


def test_a_nul_in_a_file_name_or_batch_field_is_a_400_naming_it(
        server: ServerProcess, api: openai.OpenAI) -> None:
    body = part("purpose", b"batch") + part("file", b"{}\n", "a\x00b.jsonl") + closing()
    with connect(server.port) as connection:
        connection.sendall(head("POST", "/v1/files", headers={
            "Content-Type": MULTIPART, "Content-Length": str(len(body))}) + body)
        refused = read_reply(connection)
        assert refused.status == 400 and refused.error()["param"] == "file"
        connection.sendall(head("GET", "/v1/models"))
        assert read_reply(connection).status == 200
    with pytest.raises(openai.BadRequestError) as nul_id:
        api.batches.create(input_file_id="file-\x00", endpoint="/v1/chat/completions",
                           completion_window="24h")
    assert nul_id.value.body["param"] == "input_file_id"
    # A lone surrogate is valid JSON (an escape) but no text: the official client cannot
    # even encode one, so it goes raw.
    body = (b'{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", '
            b'"completion_window": "24h", "metadata": {"k": "\\ud800"}}')
    reply, _ = exchange(server.port, head("POST", "/v1/batches", headers={
        "Content-Type": "application/json", "Content-Length": str(len(body))}), [body])
    assert reply.status == 400 and reply.error()["param"] == "metadata.k"
    uploaded = api.files.create(file=("ok.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert api.files.retrieve(uploaded.id).filename == "ok.jsonl"


def test_the_server_log_names_no_unexpected_error(server: ServerProcess) -> None:
    """Every refusal above was an answer, not a crash (runs last in this module)."""
    log = Path(server.log_path).read_text(errors="replace")
    assert "Exception in ASGI application" not in log
    assert "unexpected error" not in log
