"""`jobsvc run-batch -i IN.jsonl -o OUT.jsonl`: a batch file through the whole fleet for users
of `vllm run-batch`. The file is stored and driven as a batch of the Batch API (so it is
checked, split and routed the same way, and a second run-batch, or a server, carries on if
this one stops), with a progress bar on standard error, and the output written as vLLM's tool
writes it: one line per request in input order, errors included."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO

from jobsvc.batchapi.driver import BatchDriver, file_line
from jobsvc.batchapi.lines import ENDPOINTS, split_lines
from jobsvc.batchapi.output_lines import jsonl, vllm_line
from jobsvc.console import ProgressBar
from jobsvc.errors import JobsvcError
from jobsvc.served_models import FleetModels
from jobsvc.server.services import Services
from jobsvc.settings import Settings
from jobsvc.store.batches import COMPLETION_WINDOW, UNFINISHED, BatchRecord, BatchStore
from jobsvc.store.files import CHUNK_BYTES

_ROUND_SECONDS = 0.5


class BatchFileError(JobsvcError):
    """The input file is not a batch file jobsvc can run."""


def endpoint_of(path: Path) -> str:
    """The endpoint of the file's first request: every line must name the same one."""
    with path.open("rb") as stream:
        for _line, raw in split_lines(iter(lambda: stream.read(CHUNK_BYTES), b"")):
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError, RecursionError):
                url = None
            if url not in ENDPOINTS:
                raise BatchFileError(f"{path}: the first request's url must be one of "
                                     f"{', '.join(ENDPOINTS)}, got {url!r}")
            return str(url)
    raise BatchFileError(f"{path} holds no requests")


class _Progress:
    """The batch's requests finished, as a ProgressBar once the batch knows its total."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._bar: ProgressBar | None = None

    def show(self, batch: BatchRecord) -> None:
        if self._bar is None and batch.total:
            self._bar = ProgressBar(batch.total, batch.id, unit="request", stream=self._stream)
        if self._bar is not None:
            self._bar.reach(batch.completed + batch.failed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_batch(settings: Settings, input_path: Path, output_path: Path,
              progress_stream: IO[str] = sys.stderr) -> BatchRecord:
    """Run the file to its end and write the output; returns the batch as it ended."""
    endpoint = endpoint_of(input_path)
    services = Services.open(settings)
    try:
        with input_path.open("rb") as stream, services.files.writer(
                input_path.name, "batch") as writer:
            while chunk := stream.read(CHUNK_BYTES):
                writer.write(chunk)
        batch = services.batches.create(
            endpoint=endpoint, input_file_id=writer.file_id, completion_window=COMPLETION_WINDOW,
            metadata={"source": "jobsvc run-batch"},
            window_seconds=settings.batch_window_seconds)
        driver = services.new_driver(only=batch.id)
        progress = _Progress(progress_stream)
        try:
            batch = _drive(driver, services.batches, batch, progress)
        except KeyboardInterrupt:
            services.batches.request_cancel(batch.id)
            batch = _drive(driver, services.batches, batch, progress)
            raise
        finally:
            progress.close()
            services.batches.release(driver.name)
        if batch.status == "failed":
            listed = "; ".join(error["message"] for error in batch.errors or [])
            raise BatchFileError(f"{input_path} is not a valid batch file: {listed}")
        _write_output(services.batches, batch, services.client.models, output_path)
        return batch
    finally:
        services.close()


def _drive(driver: BatchDriver, batches: BatchStore, batch: BatchRecord,
           progress: _Progress) -> BatchRecord:
    while True:
        driver.run_round()
        current = batches.get(batch.id)
        assert current is not None
        progress.show(current)
        if current.status not in UNFINISHED:
            return current
        time.sleep(_ROUND_SECONDS)


def _write_output(batches: BatchStore, batch: BatchRecord, models: FleetModels,
                  output_path: Path) -> None:
    ending = batch.status
    with output_path.open("wb") as output:
        for rows in batches.output_pages(batch.id):
            for row in rows:
                model = models.described(row.model)
                line = file_line(batch.id, ending, row, tokenizer_model=model.weights)[1]
                output.write(jsonl(vllm_line(line, endpoint=batch.endpoint, model=model.name)))
