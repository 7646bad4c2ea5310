"""Named errors of the public API; each message says what was wrong and what to do."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import kombu.exceptions
import psycopg
import redis
from sqlalchemy.exc import SQLAlchemyError

# What a lost connection to the database or the broker raises, below jobsvc's own errors.
STORAGE_ERRORS = (SQLAlchemyError, psycopg.Error)
BROKER_ERRORS = (redis.RedisError, kombu.exceptions.KombuError, ConnectionError)


class JobsvcError(Exception):
    """Base of every error jobsvc raises on purpose."""


class InvalidJob(JobsvcError, ValueError):
    """A job was refused at submit time; nothing was enqueued or recorded. `field` names the
    field at fault, where there is one (a batch line's 400 reports it as `param`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class JobNotFound(JobsvcError, KeyError):
    """No job with this ID is recorded."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class ConfigurationError(JobsvcError):
    """A JOBSVC_* setting has a value jobsvc cannot use."""


class StorageUnavailable(JobsvcError):
    """The database could not record a submit; nothing was enqueued."""


class BrokerUnavailable(JobsvcError):
    """Redis could not take a submit's messages; nothing was kept."""


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise an outage as StorageUnavailable / BrokerUnavailable, never as a driver's own
    exception, so callers handle one documented error per service."""
    try:
        yield
    except STORAGE_ERRORS as error:
        raise StorageUnavailable(f"could not {what}: the database is unavailable "
                                 f"({type(error).__name__}); try again later") from error
    except BROKER_ERRORS as error:
        raise BrokerUnavailable(f"could not {what}: Redis is unavailable "
                                f"({type(error).__name__}); try again later") from error
