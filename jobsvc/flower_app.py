"""`jobsvc flower`: Flower on the broker, behind a password, listing every shard queue.

Three things of Flower's are changed, in this process alone:
- Its Broker page and `/api/queues/length` list only the queues that workers reported at its
  last inspection (at its start, and when Refresh is pressed), so a shard whose worker is
  down, or was still loading its engine when Flower started, had no row, though its backlog
  is what an operator needs to see (Flower issue #335). Here they list every configured or
  live shard queue (`jobsvc.fleet`), read at each page load, beside the queues workers
  consume; the worker list stays the real workers.
- Its task list shows no results: a message whose jobs failed showed as SUCCESS and nothing
  more. Here the list shows each message's result, which counts its jobs' endings.
- It shows and logs the broker URL through kombu, which masks a password (`redis://:**@…`)
  also where the URL has none; here it is masked only where there is one.

Nothing of the worker side is imported: Flower needs only the broker."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable

import redis
from flower.app import Flower
from flower.views import BaseHandler
from kombu import Connection

from jobsvc.errors import ConfigurationError
from jobsvc.fleet import listed_shards, reported_shards
from jobsvc.keys import queue_name
from jobsvc.settings import Settings, masked_url
from jobsvc.transport import make_celery

# Flower's task list with each message's result beside its state: a message runs to its end
# (state SUCCESS) whether or not its jobs succeeded, and its result counts how they ended.
TASKS_COLUMNS = "name,uuid,state,result,received,runtime,worker"
# Flower's own ways of asking for a password (basic auth, or an OAuth provider).
_AUTH_VARIABLES = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")


def shard_queue_names(settings: Settings, client: redis.Redis) -> list[str]:
    """Every configured shard's queue and every live one's."""
    return [queue_name(shard) for shard in listed_shards(settings.shards, reported_shards(client))]


def _list_shard_queues(shard_queues: Callable[[], list[str]]) -> None:
    def get_active_queue_names(handler: BaseHandler) -> list[str]:
        consumed = {queue["name"] for info in handler.application.workers.values()
                    for queue in info.get("active_queues", [])}
        return sorted(consumed | set(shard_queues()))

    BaseHandler.get_active_queue_names = get_active_queue_names


class _BrokerUrl(logging.Filter):
    """Log lines with kombu's form of the broker URL get ours instead."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self._kombus = Connection(url).as_uri()
        self._ours = masked_url(url)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._kombus in message:
            record.msg, record.args = message.replace(self._kombus, self._ours), ()
        return True


# The loggers that print the broker URL as Flower starts and connects.
_URL_LOGGERS = ("flower.command", "kombu.mixins")


def _show_broker_url(url: str) -> None:
    Flower.broker_uri = property(lambda _flower: masked_url(url))
    for name in _URL_LOGGERS:
        logging.getLogger(name).addFilter(_BrokerUrl(url))


def _is_loopback(address: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(address, None))
    except (OSError, ValueError):
        return False


def check_access(address: str, *, open_: bool) -> None:
    """Flower's pages show every message's arguments and results and its buttons stop
    workers: without a password it runs only when asked to, and only on loopback."""
    if any(os.environ.get(name) for name in _AUTH_VARIABLES):
        return
    if not open_:
        raise ConfigurationError(
            "Flower needs a password: set FLOWER_BASIC_AUTH=user:password (or FLOWER_AUTH), "
            "or pass --open to run it without one on a loopback address")
    if not _is_loopback(address):
        raise ConfigurationError(
            f"--open runs Flower without a password, so only on a loopback address, not "
            f"{address}; set FLOWER_BASIC_AUTH=user:password to serve it there")


def run_flower(settings: Settings, address: str, *, open_: bool = False) -> int:
    """Flower in this process, on `address` and JOBSVC_FLOWER_PORT (other options from its
    FLOWER_* variables); returns its exit code. The broker URL never leaves the process."""
    check_access(address, open_=open_)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    _list_shard_queues(lambda: shard_queue_names(settings, client))
    _show_broker_url(settings.redis_url)
    options = ["flower", f"--address={address}", f"--port={settings.flower_port}"]
    if not os.environ.get("FLOWER_TASKS_COLUMNS"):
        options.append(f"--tasks_columns={TASKS_COLUMNS}")
    return make_celery(settings).start(options) or 0
