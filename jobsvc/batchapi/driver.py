"""The batch driver: a thread of `jobsvc serve` that takes every unfinished batch to its end.

Each round it takes the lease of the batches no other live server drives (see
`jobsvc.store.batches`), then moves each one step: validate the file, make its lines jobs (a
slice at a time, recording each slice's lines and progress together, under idempotency keys,
so a server killed mid-slice and restarted makes no job twice), follow its jobs, and at the end
write the output and error files. Cancelling or expiry cancels the batch's unfinished jobs
through `Client.cancel_many`, and the lines never submitted end with the same error code.
Everything it knows is in the database: a restarted server, or another one once the lease
runs out, carries on where this one stopped. An outage of the database or Redis makes a step
wait for the next round; anything else one batch raises fails that batch alone, and the
round goes on to the others."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from jobsvc.batchapi.ingest import Ingestor, PreparedSlice
from jobsvc.batchapi.lines import (
    FileCheck,
    FileError,
    RawLine,
    RequestLine,
    max_line_bytes,
    parse_line,
    split_lines,
)
from jobsvc.batchapi.output_lines import (
    Answer,
    Failed,
    FinishedLine,
    Outcome,
    Refused,
    Unrun,
    ended_error,
    jsonl,
    openai_line,
)
from jobsvc.batchapi.tool_calls import ToolPlan, parser_tokenizer, plan_of, tool_answer
from jobsvc.client import Client
from jobsvc.errors import BROKER_ERRORS, BrokerUnavailable, StorageUnavailable
from jobsvc.settings import Settings
from jobsvc.store import utcnow
from jobsvc.store.batches import (
    BatchChanged,
    BatchRecord,
    BatchStore,
    LeaseLost,
    LineOutcome,
    OutputRow,
    Tally,
)
from jobsvc.store.files import FileStore, FileWriter
from jobsvc.validation import storable
from jobsvc.wire import JobStatus

log = logging.getLogger(__name__)

# Lines submitted per call: one routing decision, one transaction and one Redis pipeline each.
SLICE_LINES = 1000
# Jobs cancelled per statement.
_CANCEL_PAGE = 2000
_ROUND_SECONDS = 1.0
# What a lost database or Redis raises: the step is taken again next round (what it submitted
# is found by key). Anything else a step raises is the batch's own and ends it.
_OUTAGES = (StorageUnavailable, BrokerUnavailable, OperationalError, InterfaceError,
            DisconnectionError, PoolTimeout, *BROKER_ERRORS)
# Longest error message a failed batch keeps.
_MESSAGE_CHARS = 500


def driver_name() -> str:
    """This server's name on the batches it drives: host, process and a random part."""
    return f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class BatchDriver:
    """Takes every batch this server holds the lease of from `validating` to its end, a step per
    round, so a batch goes on after any server restarts or dies."""

    def __init__(self, settings: Settings, client: Client, ingestor: Ingestor,
                 engine: Engine, *, only: str | None = None) -> None:
        self.name = driver_name()
        # Drive this batch alone (`jobsvc run-batch`), not every batch of the fleet.
        self._only = only
        self._settings = settings
        self._lease = settings.batch_lease_seconds
        self._client = client
        self._ingestor = ingestor
        self._engine = engine
        self._batches = BatchStore(engine, settings.webhook_endpoints)
        self._files = FileStore(engine)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the rounds in a thread of their own, so the HTTP server never waits on a batch."""
        self._thread = threading.Thread(target=self._run, name="batch-driver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current step, then hand every batch this server drives back."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._batches.release(self.name)
        except Exception as error:
            log.warning("could not hand back the batches' leases (%s); others take them over "
                        "when the leases run out", error)

    def wake(self) -> None:
        """Start a round now (a batch was created or cancelled)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_round()
            except Exception:
                log.exception("batch round failed; trying again")
            self._wake.wait(_ROUND_SECONDS)
            self._wake.clear()

    def run_round(self) -> None:
        """Take the free leases and move each batch held one step."""
        for batch in self._batches.claim(self.name, self._lease, only=self._only):
            if self._stop.is_set():
                return
            try:
                self.step(batch)
            except (LeaseLost, BatchChanged) as reason:
                log.info("%s", reason)
            except _OUTAGES as outage:
                log.warning("batch %s waits: %s", batch.id, outage)
            except Exception as error:
                log.exception("batch %s failed", batch.id)
                self._fail(batch, error)

    def _fail(self, batch: BatchRecord, error: Exception) -> None:
        """End a batch that raised what no retry mends: its unfinished jobs cancelled, its
        counts adding up (every line that did not succeed failed) and the error named."""
        message = storable(f"the batch could not be run: {type(error).__name__}: "
                           f"{error}")[:_MESSAGE_CHARS]
        try:
            while job_ids := self._batches.unfinished_jobs(batch.id, _CANCEL_PAGE):
                self._client.cancel_many(job_ids)
                self._renew(batch)
            tally = self._batches.tally(batch.id)
            self._batches.end(batch.id, self.name, self._lease, "failed", tally=tally,
                              failed=batch.total - tally.succeeded,
                              errors=[FileError("batch_failed", message).to_api()])
        except Exception:
            # Taken up again next round, from whatever state the batch is left in.
            log.exception("batch %s could not be marked failed", batch.id)

    def step(self, batch: BatchRecord) -> None:
        """Move one batch one step on from the state it is in (validate, ingest a slice, follow its
        jobs, finalize); each step is safe to take again after a crash."""
        expired = _expired(batch)
        if batch.status == "validating":
            if expired:
                self._end(batch, "expired")
            else:
                self._validate(batch)
        elif batch.status == "in_progress":
            if expired:
                self._batches.expire(batch.id, self.name, self._lease)
                return
            tally = self._batches.tally(batch.id)
            if tally.lines < batch.total:
                self._ingest(batch)
            else:
                self._follow(batch, tally)
        else:
            self._end(batch, batch.ending or "completed")

    def _renew(self, batch: BatchRecord) -> None:
        self._batches.renew(batch.id, self.name, self._lease)

    def _validate(self, batch: BatchRecord) -> None:
        check = FileCheck(batch.endpoint)
        if self._files.get(batch.input_file_id) is None:
            check.errors.append(FileError("file_not_found", f"the input file "
                                          f"{batch.input_file_id} no longer exists"))
            check.failed = True
        else:
            for line, raw in self._lines(batch):
                check.add(line, raw)
                if check.over_limit:
                    break
            check.finish()
        if check.failed:
            log.info("batch %s failed validation: %s", batch.id, check.errors[0].message)
            self._batches.refuse(batch.id, self.name, self._lease,
                                 [error.to_api() for error in check.errors])
            return
        self._batches.start(batch.id, self.name, self._lease, check.requests)
        log.info("batch %s: %d requests, validated", batch.id, check.requests)
        # Its first slice goes in the next round, which need not wait.
        self.wake()

    def _lines(self, batch: BatchRecord) -> Iterator[tuple[int, RawLine]]:
        """The input file's request lines, none held longer than a request can be."""
        return split_lines(self._files.chunks(batch.input_file_id),
                           max_line_bytes(self._ingestor.context_length))

    def _remaining(self, batch: BatchRecord) -> Iterator[list[RequestLine]]:
        """The lines not yet recorded, in slices (structure was checked at validation); a
        file deleted meanwhile raises FileVanished, which fails the batch."""
        lines: list[RequestLine] = []
        for line, raw in self._lines(batch):
            if line <= batch.ingested_line:
                continue
            lines.append(parse_line(line, raw, batch.endpoint))
            if len(lines) == SLICE_LINES:
                yield lines
                lines = []
        if lines:
            yield lines

    def _ingest(self, batch: BatchRecord) -> None:
        """Submit every line not yet submitted, a slice at a time, each slice read and prepared
        (parsed, cut, tokenized) in a thread of its own while the one before is submitted; the
        request counts move with the first slice and then once a round (the first slices'
        jobs finish while later ones are read), as counting them reads every line recorded.
        A cancel, the window's end or the server stopping stops it between slices."""
        slices = self._remaining(batch)

        def prepare_next() -> PreparedSlice | None:
            lines = next(slices, None)
            return None if lines is None else self._ingestor.prepare(batch.id, batch.endpoint,
                                                                     lines)

        followed = -math.inf
        with ThreadPoolExecutor(1, thread_name_prefix="batch-prepare") as preparing:
            coming = preparing.submit(prepare_next)
            while (prepared := coming.result()) is not None:
                if self._stop.is_set() or _expired(batch):
                    return
                coming = preparing.submit(prepare_next)
                outcomes = self._ingestor.submit(prepared)
                self._batches.record_lines(batch.id, self.name, self._lease, outcomes,
                                           prepared.lines[-1].line)
                if time.monotonic() - followed >= _ROUND_SECONDS:
                    # BatchChanged once a cancel has come in: the next step ends the batch.
                    self._follow(batch, self._batches.tally(batch.id))
                    followed = time.monotonic()

    def _follow(self, batch: BatchRecord, tally: Tally) -> None:
        """Bring the request counts up to `tally`; once every line has ended, finalize."""
        self._batches.follow(batch.id, self.name, self._lease, tally,
                             finalize=tally.lines == batch.total and tally.unfinished == 0)

    def _end(self, batch: BatchRecord, ending: str) -> None:
        """Take a batch to `ending`: after a cancel or expiry, end what has not run; then
        write the output and error files and the final state, in one transaction."""
        if batch.in_progress_at is None:
            # Never validated: no line was read, so there is nothing to end or write.
            self._batches.end(batch.id, self.name, self._lease, ending)
            return
        if ending != "completed":
            while job_ids := self._batches.unfinished_jobs(batch.id, _CANCEL_PAGE):
                self._client.cancel_many(job_ids)
                self._renew(batch)
            if self._batches.tally(batch.id).lines < batch.total:
                self._end_unread(batch, ending)
        tally = self._batches.tally(batch.id)
        with self._engine.connect() as connection, connection.begin():
            output_id, error_id = self._write_files(batch, ending, connection)
            self._batches.end(batch.id, self.name, self._lease, ending, tally=tally,
                              failed=tally.lines - tally.succeeded, output_file_id=output_id,
                              error_file_id=error_id, connection=connection)
        log.info("batch %s %s: %d succeeded, %d failed", batch.id, ending, tally.succeeded,
                 tally.lines - tally.succeeded)

    def _end_unread(self, batch: BatchRecord, ending: str) -> None:
        """Record the lines never submitted as ended with the batch, error code `ending`."""
        for lines in self._remaining(batch):
            self._batches.record_lines(
                batch.id, self.name, self._lease,
                [LineOutcome(line.line, line.custom_id, None,
                             {"status_code": None, "error": ended_error(ending)})
                 for line in lines], lines[-1].line)

    def _write_files(self, batch: BatchRecord, ending: str, connection: Connection
                     ) -> tuple[str | None, str | None]:
        """The output file (requests that succeeded) and the error file (every other one),
        each line in input order; a file with no line is not made."""
        files = {kind: _LazyFile(self._files, connection, f"{batch.id}_{kind}.jsonl")
                 for kind in ("output", "error")}
        models = self._client.models
        for rows in self._batches.output_pages(batch.id):
            for row in rows:
                model = models.described(row.model)
                kind, line = file_line(batch.id, ending, row, tokenizer_model=model.weights)
                files[kind].write(jsonl(openai_line(line, endpoint=batch.endpoint,
                                                    model=model.name)))
            # A lease renewed on its own connection: this transaction has not touched the
            # batch's row yet, so it holds no lock the renewal would wait for.
            self._renew(batch)
        return files["output"].close(), files["error"].close()


def file_line(batch_id: str, ending: str, row: OutputRow, *,
              tokenizer_model: str) -> tuple[str, FinishedLine]:
    """Which file a line goes to ("output" or "error"), and what came of its request, for
    `output_lines` to shape. `tokenizer_model` is the weights of the line's model, whose
    tokenizer a tool-call parser reads."""
    outcome = _outcome(ending, row)
    if isinstance(outcome, Answer) and row.tool_plan is not None:
        outcome = _read_tool_calls(outcome, plan_of(row.tool_plan), tokenizer_model)
    line = FinishedLine(row.job_id or _line_id(batch_id, row.line), row.custom_id, outcome)
    return ("output" if isinstance(outcome, Answer) else "error"), line


def _outcome(ending: str, row: OutputRow) -> Outcome:
    """What came of a line's request: refused at ingest (as stored then), answered, failed,
    or stopped unrun by the batch's end `ending`."""
    if row.error is not None:
        if row.error["status_code"] is None:
            return Unrun(row.error["error"])
        return Refused(row.error["status_code"], row.error["error"])
    if row.status == JobStatus.SUCCEEDED.value and row.answer is not None:
        return Answer(row.job_id or "", row.answer, row.prompt_tokens or 0,
                      row.completion_tokens or 0, row.cached_tokens or 0, row.max_tokens,
                      _seconds(row.finished_at), row.finish_reason, row.choices(),
                      row.sampling,
                      created_cache_tokens=row.created_cache_tokens,
                      embeddings=row.embeddings())
    if row.status == JobStatus.FAILED.value:
        return Failed(row.job_error or "the job failed")
    return Unrun(ended_error(ending))


def _read_tool_calls(answer: Answer, plan: ToolPlan, tokenizer_model: str) -> Answer:
    """The answer with each choice read as the line's tool plan asks (the served model's
    tokenizer loaded only for a parser)."""
    tokenizer = parser_tokenizer(tokenizer_model) if plan.parser is not None else None
    return replace(answer, tool_answers=tuple(
        tool_answer(plan, choice.text, answer.reason(choice), tokenizer=tokenizer)
        for choice in answer.every_choice))


def _expired(batch: BatchRecord) -> bool:
    """Whether the batch's completion window has ended (`expires_at` is set at create and
    never changes)."""
    return batch.expires_at is not None and utcnow() >= batch.expires_at


def _line_id(batch_id: str, line: int) -> str:
    return hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()


def _seconds(moment: datetime | None) -> int:
    return int((moment or utcnow()).timestamp())


class _LazyFile:
    """A produced file that exists only once its first line is written; it commits or rolls
    back with the transaction of `connection`."""

    def __init__(self, files: FileStore, connection: Connection, filename: str) -> None:
        self._files = files
        self._connection = connection
        self._filename = filename
        self._writer: FileWriter | None = None

    def write(self, data: bytes) -> None:
        if self._writer is None:
            self._writer = self._files.writer(self._filename, "batch_output",
                                              connection=self._connection)
            self._writer.__enter__()
        self._writer.write(data)

    def close(self) -> str | None:
        if self._writer is None:
            return None
        self._writer.__exit__(None, None, None)
        return self._writer.file_id

