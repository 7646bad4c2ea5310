"""PostgreSQL (or embedded SQLite) storage: the schema and the one store that speaks to it.

PostgreSQL is the record of every job; Redis only carries them. Writes are batched (one
executemany per table per call) and idempotent, so a job delivered twice records one result.
Documents are stored once, with their tokens: queue messages name them, workers read them here.
Nothing outside this package spells a column: typed values (`records`) cross its boundary.

The store is one class users hold, made of one part per concern: recording and moving jobs
(`submitting`), claiming them and recording their outcomes (`claiming`), reading and
cancelling them (`reading`), counting them (`counts`), taking webhook deliveries from their
outbox (`webhooks`). The batch API's batches and files have stores of their own (`batches`,
`files`); every table is in `tables`, and where PostgreSQL and SQLite differ is in `dialect`.
"""

from jobsvc.store.claiming import Claiming
from jobsvc.store.counts import Counting
from jobsvc.store.dialect import make_engine
from jobsvc.store.reading import Reading
from jobsvc.store.records import (
    Cancelled,
    Claim,
    ClaimedJob,
    JobOutcome,
    JobRecord,
    MessageStats,
    MovableJob,
    NewDocument,
    NewJob,
    SentJob,
    utcnow,
)
from jobsvc.store.submitting import Submitting
from jobsvc.store.webhooks import WebhookDeliveries


class Store(Submitting, Claiming, Reading, Counting, WebhookDeliveries):
    """The repository: every read and write of jobs, results, statistics and webhook
    deliveries goes through here."""


__all__ = ["Cancelled", "Claim", "ClaimedJob", "JobOutcome", "JobRecord", "MessageStats",
           "MovableJob", "NewDocument", "NewJob", "SentJob", "Store", "make_engine",
           "utcnow"]
