"""Records finished jobs off the engine's path: one thread gathers finished results, writes
them in one transaction per gathering, returns the load of the jobs that write ended (as the
store recorded it, never as a message said), tells the router how its
cache estimates for them held up, and only then releases the message that waits for them (its
message is acknowledged after that, so nothing finished is lost).

The thread wakes twice per gathering (its first result, and the result that completes a message
or the end of the gathering window), not once per job: on a host whose cores the engine keeps
busy, every wakeup outside the engine preempts one of the engine's threads, and a step waits
for all of them."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jobsvc.routing.feedback import CacheFeedback
from jobsvc.routing.job_cost import loads_per_shard
from jobsvc.routing.ledger import LoadLedger
from jobsvc.store import JobOutcome, MessageStats, Store

log = logging.getLogger(__name__)

# At most this many items (results, message statistics, load returns) go into one write.
_MAX_GATHERED = 1024
# How long a write waits for more results after its first, unless a message completes sooner.
# A burst's jobs finish a few per engine step, and each write costs a transaction of several
# round trips in the worker and in PostgreSQL whatever it holds, so gathering cuts the writes
# and their CPU, which is taken from the engine. A message's slot is held until its last result
# is written, so the write that completes a message goes at once; this bound only delays the
# results of jobs whose message is still generating.
_GATHER_SECONDS = 1.0
_RETRY_SECONDS = (0.5, 1, 2, 5, 10)


class Completion:
    """Counts down as a message's jobs finish, and as their results are committed."""

    def __init__(self, jobs: int) -> None:
        self._unfinished = jobs
        self._uncommitted = jobs
        self._lock = threading.Lock()
        self._done = threading.Event()
        if jobs == 0:
            self._done.set()

    def finished(self) -> bool:
        """Count one job finished; True if it was the message's last."""
        with self._lock:
            self._unfinished -= 1
            return self._unfinished == 0

    def committed(self, jobs: int) -> None:
        """Count `jobs` of the message's results committed; the last one lets the message return."""
        with self._lock:
            self._uncommitted -= jobs
            if self._uncommitted <= 0:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every result of the message to be committed; false if `timeout` passed first."""
        return self._done.wait(timeout)


@dataclass(frozen=True)
class CacheCheck:
    """What the router expected the engine to find cached for a job, to learn from."""

    expected_tokens: int
    document_tokens: int


@dataclass
class _Pending:
    outcomes: list[JobOutcome] = field(default_factory=list)
    # (shard, load) of every job this gathering ended.
    releases: list[tuple[int, int]] = field(default_factory=list)
    # Per shard: expected minus actual cached blocks summed, longest document in blocks.
    cache_errors: dict[int, tuple[int, int]] = field(default_factory=dict)
    completions: dict[int, tuple[Completion, int]] = field(default_factory=dict)
    messages: list[MessageStats] = field(default_factory=list)
    started: dict[str, datetime] = field(default_factory=dict)


class ResultRecorder:
    """Writes results from a thread of its own, gathered into few transactions, so the engine's loop
    never waits on the database."""

    def __init__(self, store: Store, ledger: LoadLedger, feedback: CacheFeedback,
                 block_size: int, gather_seconds: float = _GATHER_SECONDS) -> None:
        self._store = store
        self._gather_seconds = gather_seconds
        self._ledger = ledger
        self._feedback = feedback
        self._block_size = block_size
        self._gathered: list[tuple[str, Any]] = []
        self._message_completed = False
        self._stopping = False
        self._wake = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._run, name="result-recorder", daemon=True)

    def start(self) -> None:
        """Start the recording thread."""
        self._thread.start()

    def stop(self) -> None:
        """Write everything gathered so far, then stop."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def job_finished(self, outcome: JobOutcome, shard: int, check: CacheCheck,
                     completion: Completion) -> None:
        """Hand over a job's outcome to be written; its message counts it once it is committed."""
        self._gather(("job", (outcome, shard, check, completion)),
                     completes_message=completion.finished())

    def jobs_started(self, job_ids: list[str], started_at: datetime) -> None:
        """Jobs admitted to the engine: they show as running from the next write on."""
        self._gather(("started", (job_ids, started_at)))

    def message_finished(self, stats: MessageStats) -> None:
        """Hand over a message's statistics to be written with the next results."""
        self._gather(("message", stats))

    def release_load(self, releases: dict[int, int]) -> None:
        """Return the load of jobs that ended without running (failed at their claim)."""
        if releases:
            self._gather(("release", releases))

    def _gather(self, item: tuple[str, Any], completes_message: bool = False) -> None:
        with self._wake:
            self._gathered.append(item)
            self._message_completed = self._message_completed or completes_message
            # The recorder sleeps until a gathering starts, then until it must write.
            if (len(self._gathered) == 1 or completes_message
                    or len(self._gathered) >= _MAX_GATHERED):
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._gathered or self._stopping)
                # A message waits on the write that completes it: that one goes at once.
                self._wake.wait_for(lambda: self._message_completed or self._stopping
                                    or len(self._gathered) >= _MAX_GATHERED,
                                    timeout=self._gather_seconds)
                items, self._gathered, self._message_completed = self._gathered, [], False
                stopping = self._stopping
            pending = _Pending()
            for item in items:
                self._add(pending, item)
            self._write(pending)
            if stopping:
                return

    def _add(self, pending: _Pending, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "message":
            pending.messages.append(payload)
            return
        if kind == "started":
            job_ids, started_at = payload
            pending.started.update(dict.fromkeys(job_ids, started_at))
            return
        if kind == "release":
            pending.releases += payload.items()
            return
        outcome, shard, check, completion = payload
        pending.outcomes.append(outcome)
        if outcome.error is None:
            error, floor = pending.cache_errors.get(shard, (0, 0))
            pending.cache_errors[shard] = (
                error + (check.expected_tokens - outcome.cached_tokens) // self._block_size,
                max(floor, check.document_tokens // self._block_size))
        known, count = pending.completions.get(id(completion), (completion, 0))
        pending.completions[id(completion)] = (known, count + 1)

    def _write(self, pending: _Pending) -> None:
        if pending.outcomes or pending.messages or pending.started:
            pending.releases += self._record_until_done(pending).items()
        try:
            self._ledger.release(loads_per_shard(pending.releases))
            self._feedback.jobs_ran(pending.cache_errors)
        except Exception as error:
            log.warning("could not return shard load %s or cache feedback: %s",
                        pending.releases, error)
        for completion, count in pending.completions.values():
            completion.committed(count)

    def _record_until_done(self, pending: _Pending) -> dict[int, int]:
        """Write until it succeeds: a database outage delays results, it never drops them
        (outcome writes are idempotent, so a retry after a partial success is harmless).
        Returns the load of the jobs the write ended, by shard."""
        attempt = 0
        while True:
            try:
                return self._store.record_outcomes(pending.outcomes, pending.messages,
                                                   pending.started)
            except Exception as error:
                delay = _RETRY_SECONDS[min(attempt, len(_RETRY_SECONDS) - 1)]
                reason = str(error).splitlines()[0][:300]
                log.warning("recording %d results failed (%s: %s); retrying in %.1f s",
                            len(pending.outcomes), type(error).__name__, reason, delay)
                time.sleep(delay)
                attempt += 1
