"""Conditions on jobs that statements of several concerns share, each written once."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement

from jobsvc.store.tables import Job
from jobsvc.wire import FINISHED_STATUSES, JobStatus

FINISHED = sorted(status.value for status in FINISHED_STATUSES)


def unfinished(status: Any) -> ColumnElement[bool]:
    """The status test of statements that pick jobs by ID. With `status IN (queued,
    running)` the planner may also walk the status index: every active entry and, until a
    vacuum, every once-active one (two per finished job), a walk that makes a claim far slower
    than the lookup by primary key alone. `NOT IN` the finished statuses, which no index
    serves, leaves the lookup by key."""
    return status.not_in(FINISHED)


def sent_before(moment: datetime) -> ColumnElement[bool]:
    """The job's message was sent before `moment`; one with no send time counts as sent."""
    return or_(Job.enqueued_at.is_(None), Job.enqueued_at < moment)


def unclaimed() -> ColumnElement[bool]:
    """Queued, and no worker has claimed the job."""
    return and_(Job.worker.is_(None), Job.status == JobStatus.QUEUED.value)
