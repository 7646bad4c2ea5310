"""What a `jobsvc bench` run does: its options, the checks that refuse contradictory ones, the
devices its shards bind, and the jobs of each trial. The driver (`run`), the scripts beside it
(`assignment`, `interference`) and the command line all build their runs from here, so that a
workload or an option means the same to each of them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobsvc.bench.standalone import ADMISSION_MODES
from jobsvc.errors import ConfigurationError
from jobsvc.settings import Settings
from jobsvc.workloads import document_questions, read_jsonl_jobs, uneven_jobs

# Documents and questions per document of the even workloads.
NAMED_WORKLOADS = {"unique": (64, 1), "reuse": (64, 4), "structured": (64, 4)}
# `structured`: the `reuse` jobs (each trial's documents and questions the same), each asking
# for an answer that fits STRUCTURED_SCHEMA, given as OpenAI's `response_format`. Its values are
# enumerated, so that sampling at temperature 1 closes the object well within
# STRUCTURED_MAX_TOKENS even with random weights (a free string, or greedy decoding, runs on to
# the cap); a seed per job has both arms of a pair sample the same answers. `--output-tokens`
# does not apply: the schema, not a count, ends each answer.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"label": {"enum": ["supported", "contradicted", "unmentioned"]},
                   "grade": {"enum": [1, 2, 3]}},
    "required": ["label", "grade"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 128
# `zipf`: as many jobs as `reuse` on as many documents, asked with Zipf popularity (the most
# asked document draws a fifth of the jobs, most are asked once or twice).
ZIPF_JOBS, ZIPF_DOCUMENTS = 256, 64
# The device of each shard, space-separated: GPU indices on GPU hosts, core lists such as 0-1
# on CPU hosts. Unset: the split of a 2-core CPU host.
DEVICES_VARIABLE = "JOBSVC_BENCH_DEVICES"


def shard_devices(shards: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The device each shard's worker binds (`--device`), and the standalone arm's engine of
    that shard: DEVICES_VARIABLE when set, so that a GPU host runs the same code with GPU
    indices; else both cores of a 2-core CPU host for one shard, one core each for more. The
    bench's one setting of its own, and the one place it is read."""
    devices = environ.get(DEVICES_VARIABLE, "").split()
    if not devices:
        return ["0-1"] if shards == 1 else [str(shard % 2) for shard in range(shards)]
    if len(devices) != shards:
        raise ConfigurationError(f"{DEVICES_VARIABLE} names {len(devices)} devices for "
                                 f"{shards} shards; give one per shard")
    return devices


@dataclass(frozen=True)
class BenchOptions:
    """What a `jobsvc bench` run does, from its command line; every field has a default, so tests
    and scripts name only what they change."""

    workload: str = "reuse"
    shards: int = 1
    # Routing policy of the service arm (and so of the standalone arm's plan); None keeps
    # JOBSVC_ROUTING.
    policy: str | None = None
    trials: int = 7
    words: int = 520  # about 1,500 tokens of the tiny model's tokenizer
    output_tokens: int = 16
    json_path: Path | None = None
    plot_path: Path | None = None
    log_dir: Path = Path("bench-logs")
    # Start both arms' engines afresh before every pair. Two engines started alike can differ
    # in speed for their whole life; fresh ones turn that lasting bias between the arms into
    # noise between pairs, which the median over pairs can see through.
    fresh_engines: bool = False
    # Run the standalone arm on the service workers' own engines, driven directly inside each
    # worker process with the queue and database left out. Both arms of a pair then meet the
    # same engine, and a difference in speed between engine instances cannot enter the ratio.
    # Otherwise the bench process starts engines of its own for the standalone arm.
    standalone_on_workers: bool = True
    # A/A run: the standalone arm also takes the service's place in every pair, so the ratios
    # show what this host's noise alone does to them (the spread a service with no overhead
    # at all would measure here).
    standalone_twice: bool = False
    # A/B run of the service against itself: in the standalone arm's place, the same workers
    # with each message admitted at once (an admission chunk of 0), so that the pairs show
    # what paced admission gains or costs. Each slot of a pair submits documents of its own,
    # so that neither finds the other's already stored.
    compare_admission: bool = False
    # The standalone arm's admission style (`jobsvc.bench.standalone.ADMISSION_MODES`), fixed for
    # the run; None calibrates between the styles and keeps the faster. A fixed style lets
    # two runs, one per style, measure the service against each with the same workload.
    standalone_admission: str | None = None


def check_options(settings: Settings, options: BenchOptions) -> None:
    """Refuse combinations of options that would not measure what they name."""
    if options.standalone_admission not in (None, *ADMISSION_MODES):
        raise ConfigurationError(f"--standalone-admission must be one of {ADMISSION_MODES}, "
                                 f"not {options.standalone_admission!r}")
    if not options.compare_admission:
        return
    if options.standalone_admission:
        raise ConfigurationError("--compare-admission runs no standalone arm; leave out "
                                 "--standalone-admission")
    if options.standalone_twice:
        raise ConfigurationError("--compare-admission and --standalone-twice each replace an "
                                 "arm; run them separately")
    if not options.standalone_on_workers:
        raise ConfigurationError("--compare-admission runs no standalone engines; leave out "
                                 "--own-standalone-engines")
    if settings.admission_chunk == 0:
        raise ConfigurationError("--compare-admission compares JOBSVC_ADMISSION_CHUNK with 0 "
                                 "(each message admitted at once), and it is 0; set it to the "
                                 "chunk to compare, such as 32")


def arm_names(options: BenchOptions) -> tuple[str, str]:
    """What runs in the service arm's slot and in the standalone arm's slot of each pair."""
    if options.standalone_twice:
        return "standalone", "standalone"
    if options.compare_admission:
        return "service paced", "service all at once"
    return "service", "standalone"


def bench_jobs(options: BenchOptions, trial: int) -> list[dict[str, Any]]:
    """The jobs of one trial: named workloads get fresh documents per trial, JSONL files
    replay the same jobs (the prefix caches are reset between trials either way)."""
    fixed = {"max_tokens": options.output_tokens, "ignore_eos": True, "temperature": 0.0}
    if options.workload in NAMED_WORKLOADS:
        documents, questions = NAMED_WORKLOADS[options.workload]
        generated = document_questions(documents, questions, options.words, seed=1000 + trial)
    elif options.workload == "zipf":
        generated = uneven_jobs(ZIPF_JOBS, ZIPF_DOCUMENTS, (options.words, options.words),
                                seed=1000 + trial)
    else:
        return [{**fixed, **job} for job in read_jsonl_jobs(Path(options.workload))]
    if options.workload == "structured":
        return [{"document": job.document, "question": job.question, **structured_sampling(seed)}
                for seed, job in enumerate(generated)]
    return [{"document": job.document, "question": job.question, **fixed} for job in generated]


def output_tokens(options: BenchOptions) -> int | None:
    """How long each answer of a named workload is: `--output-tokens` (end of sequence
    ignored), or None where a schema ends each answer."""
    return None if options.workload == "structured" else options.output_tokens


def structured_sampling(seed: int) -> dict[str, Any]:
    """A `structured` job's sampling as a producer gives it to `Client.submit_many`."""
    return {"max_tokens": STRUCTURED_MAX_TOKENS, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "verdict", "schema": STRUCTURED_SCHEMA,
                                                "strict": True}}}
