"""Ingest of the Batch API: how fast `jobsvc serve` takes a batch file from upload to every
request enqueued, and how much memory its process needs for it.

    python -m jobsvc.bench.ingest [--lines 50000] [--questions 4] [--words 300] [--json PATH]

It writes a chat batch file whose lines ask several questions of each document (the
document in a system message, as files built for prefix caching do), starts `jobsvc serve`
as a child process on the configured database and Redis, uploads the file with the official
`openai` client, and times validation and ingestion (until every line has its job) from the
batch's own record. Peak memory is the server's peak resident set (VmHWM) before the upload
and after ingest. Beside them, what the machine allows for the same file: the model's
tokenizer alone on each slice's distinct prefixes and its suffixes, cut as the server cuts
them, and a raw `COPY` of the batch's job rows. No worker needs to run: the jobs stay queued,
so use a database and Redis of their own and drop them afterwards."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import psycopg

from jobsvc.batchapi.chat_template import ChatTemplate
from jobsvc.batchapi.driver import SLICE_LINES
from jobsvc.bench.controlplane import copy_rows_per_s, postgres_conninfo
from jobsvc.child_processes import ServerProcess
from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings
from jobsvc.store import make_engine
from jobsvc.store.batches import BatchRecord, BatchStore
from jobsvc.workloads import document, question

_API_KEY = "bench-ingest"


def write_file(path: Path, lines: int, questions: int, words: int, seed: int = 46) -> None:
    """`lines` chat requests, `questions` consecutive ones per document."""
    rng = random.Random(seed)
    with path.open("w") as output:
        text = ""
        for index in range(lines):
            if index % questions == 0:
                text = document(rng, words)
            output.write(json.dumps({"custom_id": f"r{index}", "method": "POST",
                                     "url": "/v1/chat/completions", "body": {
                                         "model": "jobsvc", "max_tokens": 16, "messages": [
                                             {"role": "system", "content": text},
                                             {"role": "user", "content": question(rng)}]}}))
            output.write("\n")


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for process {pid}")


def measure(settings: Settings, path: Path, port: int, log: Path) -> dict[str, Any]:
    """Upload the batch file to a fresh server and time it from upload to every request enqueued,
    with the server's peak memory beside it; a one-line batch warms the server first."""
    server = ServerProcess(replace(settings, api_key=_API_KEY), port, log)
    server.start()
    try:
        api = openai.OpenAI(base_url=server.url, api_key=_API_KEY, timeout=600, max_retries=0)
        # Warm: the tokenizer and chat template load with a first, one-line batch.
        with path.open("rb") as stream:
            first_line = stream.readline()
        warm = api.files.create(file=("warm.jsonl", io.BytesIO(first_line)), purpose="batch")
        batches = BatchStore(make_engine(settings.resolved_database_url))
        warm_batch = api.batches.create(input_file_id=warm.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        _wait_ingested(batches, warm_batch.id)
        rss_before = peak_rss_kib(server.pid)
        size = path.stat().st_size
        started = time.monotonic()
        with path.open("rb") as stream:
            uploaded = api.files.create(file=(path.name, stream), purpose="batch")
        uploaded_at = time.monotonic()
        batch = api.batches.create(input_file_id=uploaded.id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
        record = _wait_ingested(batches, batch.id)
        ingested_at = time.monotonic()
        assert record.in_progress_at is not None
        validate_seconds = (record.in_progress_at - record.created_at).total_seconds()
        ingest_seconds = ingested_at - uploaded_at
        lines = record.total
        return {
            "lines": lines, "file_bytes": size,
            "upload_seconds": round(uploaded_at - started, 2),
            "validate_seconds": round(validate_seconds, 2),
            "batch_to_enqueued_seconds": round(ingest_seconds, 2),
            "lines_per_second": round(lines / ingest_seconds, 1),
            "megabytes_per_second": round(size / 1e6 / (ingested_at - started), 2),
            "server_peak_rss_mib_before": round(rss_before / 1024, 1),
            "server_peak_rss_mib_after": round(peak_rss_kib(server.pid) / 1024, 1),
        }
    finally:
        server.stop(timeout=60)


def tokenizer_limit(settings: Settings, path: Path) -> float:
    """Lines per second of the model's tokenizer alone on the file, called as the server calls
    it: per slice, once for the slice's distinct prefixes and once for its suffixes."""
    template, prompts = ChatTemplate(settings.model), PromptBuilder(settings.model)
    spent, lines = 0.0, 0
    with path.open("rb") as stream:
        while batch := list(itertools.islice(stream, SLICE_LINES)):
            splits = [template.split(json.loads(raw)["body"]["messages"]) for raw in batch]
            started = time.perf_counter()
            prompts.encode(list(dict.fromkeys(split.prefix for split in splits)), special=False)
            prompts.encode([split.suffix for split in splits], special=False)
            spent += time.perf_counter() - started
            lines += len(batch)
    return lines / spent


def limits(settings: Settings, path: Path, lines: int) -> dict[str, float]:
    """What the machine allows for the same file, in lines per second: the tokenizer alone,
    and a raw `COPY` of the batch's jobs (the newest rows, a slice per transaction)."""
    with psycopg.connect(postgres_conninfo(settings.resolved_database_url)) as conn:
        copy = copy_rows_per_s(conn, lines, SLICE_LINES)
    return {"tokenizer_lines_per_second": round(tokenizer_limit(settings, path)),
            "copy_jobs_per_second": round(copy)}


def _wait_ingested(batches: BatchStore, batch_id: str) -> BatchRecord:
    """Poll the batch's record until every line has its row (its job enqueued)."""
    while True:
        record = batches.get(batch_id)
        assert record is not None
        if record.status == "failed":
            raise RuntimeError(f"the batch failed: {record.errors}")
        if record.status != "validating" and record.total and (
                record.ingested_line >= record.total):
            return record
        time.sleep(0.2)


def main() -> None:
    """`python -m jobsvc.bench.ingest`: write a batch file, time its ingest, print the result
    as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--questions", type=int, default=4, help="questions per document")
    parser.add_argument("--words", type=int, default=300,
                        help="words per document (300, about 870 tokens, keeps 50,000 lines "
                             "under the 200 MB upload limit)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--json", type=Path, default=Path("bench-out/ingest.json"),
                        help="write the result here too (default: %(default)s)")
    args = parser.parse_args()
    settings = Settings.from_env()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "batch.jsonl"
        write_file(path, args.lines, args.questions, args.words)
        result = {"questions_per_document": args.questions, "words": args.words,
                  "shards": settings.shards,
                  **measure(settings, path, args.port, Path(folder) / "serve.log")}
        result["limit"] = limits(settings, path, result["lines"])
    print(json.dumps(result, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
