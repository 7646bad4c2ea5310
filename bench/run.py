"""`jobsvc bench`: finite bursts through the service and through standalone vLLM, in
alternated pairs, with throughput, CPU-seconds per job and cache figures as JSON. By default
the standalone arm drives the service workers' own engines directly, so that both arms of a
pair meet the same engine instance.

Both arms share the machine, the engine configuration, the shard count, the documents and the
document-to-engine assignment; each pair reverses the order of the previous one, and every
trial starts from a cold prefix cache. Wall-clock throughput on a shared 2-core machine varies
by several percent between runs; CPU-seconds per job, summed over every process an arm uses,
is the steadier measure of what the service costs on top of the engine."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import redis

from jobsvc.bench.measure import (
    DISTURBED_SHARE,
    ArmResult,
    Pair,
    ideal_hit_rate,
    mean_shard_seconds,
    milliseconds,
    outside_engine_ms_per_job_by_role,
    parity_checks,
    percentile,
    reading_at,
    shard_finish_spread_seconds,
    summarize_pairs,
)
from jobsvc.bench.probes import HOOKS_PATH
from jobsvc.bench.processes import (
    FOREIGN_CPU,
    MACHINE_CPU,
    RUNNER_WAIT,
    STEAL,
    Member,
    Usage,
    server_processes,
    with_roles,
)
from jobsvc.bench.standalone import ADMISSION_MODES, StandaloneEngines, StandaloneRun, as_job
from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.errors import ConfigurationError
from jobsvc.migrate import upgrade_to_head
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.job_cost import RoutingJob, decode_load
from jobsvc.routing.prefix import document_keys
from jobsvc.routing.router import Router, make_router, reset_routing_state
from jobsvc.routing.state import ShardState
from jobsvc.settings import Settings
from jobsvc.transport import make_celery
from jobsvc.wire import JobStatus
from jobsvc.workloads import document_questions, read_jsonl_jobs, uneven_jobs

log = logging.getLogger(__name__)

# Documents and questions per document of the even workloads.
NAMED_WORKLOADS = {"unique": (64, 1), "reuse": (64, 4)}
# `zipf`: as many jobs as `reuse` on as many documents, asked with Zipf popularity (the most
# asked document draws a fifth of the jobs, most are asked once or twice).
ZIPF_JOBS, ZIPF_DOCUMENTS = 256, 64
# The service arm's producer waits as `Client.wait` does by default: it checks its unfinished
# jobs once the commits announced since its last check could have finished all of them, and
# at least every `finish_signal.NOTIFIED_CHECK_SECONDS`, or every _POLL_SECONDS without
# notifications. Each check asks only for the jobs still unfinished.
_POLL_SECONDS = 1.0
# After the check that finds every job finished: how long a notification of the commit that
# finished the last one may take to arrive, if that commit landed during the check.
_LAST_COMMIT_GRACE_SECONDS = 0.2
# Quiet time before each arm, so that neither starts while the other's trailing work (the
# last acknowledgements and statistics, an engine's threads winding down) still runs.
_SETTLE_SECONDS = 1.0
# How long a standalone burst on the workers' engines may take before the bench gives up.
_WORKER_BURST_TIMEOUT_SECONDS = 1800.0
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
    return [{"document": job.document, "question": job.question, **fixed} for job in generated]


@dataclass
class TrialShape:
    """What a trial's jobs look like to the router, computed outside the timed region."""

    shard_of_job: list[int]
    ideal_hit_rate: float
    bytes_raw: int


def trial_shape(jobs: Sequence[dict[str, Any]], prompts: PromptBuilder, router: Router
                ) -> TrialShape:
    """What the router makes of a trial's jobs (their shards, the ideal hit rate, their size),
    computed before the timed region so neither arm pays for it."""
    distinct = list(dict.fromkeys(job["document"] for job in jobs))
    tokens = dict(zip(distinct, prompts.documents(distinct), strict=True))
    questions = prompts.questions([job["question"] for job in jobs])
    block_size = router.settings.block_size
    keys = {text: document_keys(tokens[text], block_size) for text in distinct}
    decode_cost = router.settings.routing_decode_cost
    per_job = [RoutingJob(keys[job["document"]], len(tokens[job["document"]]) + len(question),
                          decode_load(job["max_tokens"], decode_cost))
               for job, question in zip(jobs, questions, strict=True)]
    return TrialShape(
        shard_of_job=router.plan(per_job),
        ideal_hit_rate=ideal_hit_rate(
            [(routed.keys.document_key, len(tokens[job["document"]]), routed.prompt_tokens)
             for job, routed in zip(jobs, per_job, strict=True)], block_size),
        bytes_raw=sum(len(json.dumps(job, separators=(",", ":"))) for job in jobs))


def _server_members(servers: Mapping[str, Iterable[psutil.Process]]) -> list[Member]:
    """Redis's and PostgreSQL's processes, each with its role."""
    return [member for role, processes in servers.items()
            for member in with_roles(processes, role, descendants=False)]


@dataclass
class _GcTotals:
    """Each worker's longest GC pauses and its collections, over the bursts of one arm: while
    it had work in flight, and (`idle_*`) while it had none."""

    pause_max_ms: dict[str, float] = field(default_factory=dict)
    pause_max_ms_by_generation: dict[str, list[float]] = field(default_factory=dict)
    cpu_max_ms: dict[str, float] = field(default_factory=dict)
    collections_by_generation: dict[str, list[int]] = field(default_factory=dict)
    idle_pause_max_ms: dict[str, float] = field(default_factory=dict)
    idle_collections: dict[str, int] = field(default_factory=dict)

    def add(self, replies: Iterable[Mapping[str, Mapping[str, Any]]]) -> None:
        """Fold in the workers' `take_gc_pauses` readings."""
        for reply in replies:
            for worker, reading in reply.items():
                self.pause_max_ms[worker] = max(self.pause_max_ms.get(worker, 0.0),
                                                reading["gc_pause_max_ms"])
                self.cpu_max_ms[worker] = max(self.cpu_max_ms.get(worker, 0.0),
                                              reading["gc_cpu_max_ms"])
                self.idle_pause_max_ms[worker] = max(self.idle_pause_max_ms.get(worker, 0.0),
                                                     reading["gc_idle_pause_max_ms"])
                self.idle_collections[worker] = (self.idle_collections.get(worker, 0)
                                                 + reading["gc_idle_collections"])
                by_generation = self.pause_max_ms_by_generation.setdefault(
                    worker, [0.0, 0.0, 0.0])
                by_generation[:] = map(max, by_generation,
                                       reading["gc_pause_max_ms_by_generation"])
                collections = self.collections_by_generation.setdefault(worker, [0, 0, 0])
                collections[:] = map(sum, zip(collections,
                                              reading["gc_collections_by_generation"],
                                              strict=True))


@dataclass
class _Totals:
    """Service-side figures accumulated over all trials."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    standalone_prompt_tokens: int = 0
    standalone_cached_tokens: int = 0
    shard_jobs: list[int] = field(default_factory=list)
    admission_ms: list[float] = field(default_factory=list)
    recording_lag_ms: list[float] = field(default_factory=list)
    # Per burst: from the last result's `recorded_at` stamp to the producer hearing its commit.
    heard_after_recorded_ms: list[float] = field(default_factory=list)
    gc: _GcTotals = field(default_factory=_GcTotals)
    # The same workers' collections during the standalone arm, when it drives their engines:
    # what vLLM's front end and the host cost the process without the service's work.
    standalone_gc: _GcTotals = field(default_factory=_GcTotals)
    bytes_enqueued: list[int] = field(default_factory=list)
    failed: int = 0


class Bench:
    """One bench run's moving parts: the service's workers, the standalone arm's engines
    (where it has its own), and the producer's view of routing, with the totals both arms
    add up pair by pair. Scripts that race other settings on the same engines use it too."""

    def __init__(self, settings: Settings, options: BenchOptions,
                 progress: Callable[[str], None]) -> None:
        self.settings = settings
        self.options = options
        self.progress = progress
        devices = shard_devices(settings.shards)
        self.workers = LocalWorkers(replace(settings, worker_hooks=HOOKS_PATH), options.log_dir,
                                    devices=list(devices))
        self.devices = devices
        self.engines: StandaloneEngines | None = None
        self.redis = redis.Redis.from_url(settings.redis_url)
        self.celery = make_celery(settings)
        self.prompts = PromptBuilder(settings.model, settings.max_model_len)
        self.router = make_router(self.redis, ShardState(self.redis), settings)
        self.totals = _Totals(shard_jobs=[0] * settings.shards)
        # The service admitting each message at once, in an admission A/B run.
        self.all_at_once_totals = _Totals(shard_jobs=[0] * settings.shards)

    def service_roots(self) -> list[psutil.Process]:
        """The service workers' processes, whose descendants are the engines."""
        return [psutil.Process(process.pid) for process in self.workers.processes]

    def service_processes(self, servers: Mapping[str, Iterable[psutil.Process]]
                          ) -> list[Member]:
        """Every process the service arm uses, with its role."""
        return [*with_roles([psutil.Process()], "producer", descendants=False),
                *with_roles(self.service_roots(), "worker", descendants=True),
                *_server_members(servers)]

    def standalone_processes(self, servers: Mapping[str, Iterable[psutil.Process]]
                             ) -> list[Member]:
        """The bench process (which drives the engines, or waits for the workers to), the
        engines it drives (its own, or the workers' with their processes), and Redis and
        PostgreSQL: this arm does not use them, but they run beside it on the same cores as
        beside the service arm (Redis's timers take CPU even with no client connected), so
        each arm is charged what they took during its burst."""
        members = _server_members(servers)
        if self.options.standalone_on_workers:
            return [*members, *with_roles([psutil.Process()], "bench", descendants=False),
                    *with_roles(self.service_roots(), "worker", descendants=True)]
        service = {member.pid for member, _ in with_roles(self.service_roots(), "worker",
                                                        descendants=True)}
        return [*members, *((member, role)
                            for member, role in with_roles([psutil.Process()], "bench",
                                                         descendants=True)
                            if member.pid not in service)]

    def start_engines(self, standalone_first: bool = False) -> None:
        """Start the service's workers and the standalone arm's engines, in either order (of
        two engines started one after the other, either may run faster for its whole life, so
        a fixed order could favour one arm)."""
        if self.options.standalone_on_workers:
            self.workers.start()
            return
        if not standalone_first:
            self.workers.start()
        self.engines = StandaloneEngines(self.settings, self.devices)
        if standalone_first:
            self.workers.start()

    def stop_engines(self) -> None:
        """Stop the standalone engines and the service's workers."""
        if self.engines is not None:
            self.engines.shutdown()
            self.engines = None
        self.workers.stop()

    def ask_workers(self, command: str, timeout: float,
                    arguments: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A remote-control command's replies. Without a limit a broadcast waits out its whole
        timeout; with one reply per worker it returns as soon as every worker has answered."""
        return self.celery.control.broadcast(command, arguments=arguments, reply=True,
                                             timeout=timeout, limit=len(self.workers.processes))

    def ask_every_worker(self, command: str, timeout: float,
                         arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """Each worker's reply to a command that every one of them must carry out."""
        replies = [reading for reply in self.ask_workers(command, timeout, arguments)
                   for reading in reply.values()]
        if len(replies) != len(self.workers.processes):
            raise RuntimeError(f"{len(replies)} of {len(self.workers.processes)} workers "
                               f"answered {command}")
        failed = [reply["error"] for reply in replies if "error" in reply]
        if failed:
            raise RuntimeError(f"{command} failed on a worker: {failed[0]}")
        return replies

    def engine_step_totals(self, on_workers: bool) -> dict[str, float] | None:
        """The workers' engines' steps so far and the tokens they computed, summed; None for
        engines of the bench's own (their counters share this process's registry, so they
        would not be told apart)."""
        if not on_workers:
            return None
        replies = self.ask_every_worker("engine_steps", timeout=5, arguments={})
        return {part: sum(reply[part] for reply in replies) for part in ("steps", "tokens")}

    def pace_admission(self, chunk: int, pause_ms: float) -> None:
        """Have every worker pace the batches it admits from now on."""
        self.ask_every_worker("set_admission_pacing", timeout=10,
                              arguments={"chunk": chunk, "pause_ms": pause_ms})

    def run_on_workers(self, jobs_by_shard: list[list[tuple[str, str, dict[str, Any]]]],
                       mode: str) -> StandaloneRun:
        """One standalone burst on the workers' own engines, every shard at once."""
        replies = self.ask_every_worker(
            "run_standalone_burst", timeout=_WORKER_BURST_TIMEOUT_SECONDS,
            arguments={"jobs_by_shard": jobs_by_shard, "mode": mode})
        runs = [StandaloneRun(**reply) for reply in replies]
        return StandaloneRun(
            started=min(run.started for run in runs), admitted=min(run.admitted for run in runs),
            finished=max(run.finished for run in runs),
            engines_finished=[moment for run in runs for moment in run.engines_finished],
            **{part: sum(getattr(run, part) for run in runs)
               for part in ("output_tokens", "prompt_tokens", "cached_tokens")})

    def run_service(self, client: Client, jobs: list[dict[str, Any]], shape: TrialShape,
                    totals: _Totals | None) -> ArmResult:
        """One burst through the service; its queue, routing and collection figures go into
        `totals` (none for an unrecorded burst)."""
        self.ask_workers("reset_prefix_cache", timeout=10)
        reset_routing_state(self.redis, self.settings.shards)
        self.ask_workers("take_gc_pauses", timeout=5)
        self.ask_workers("take_first_admission", timeout=5)
        steps_before = self.engine_step_totals(on_workers=True)
        time.sleep(_SETTLE_SECONDS)
        # The arm ends when the producer hears of the commit that finished its last job: the
        # notification that preceded the check finding none unfinished, or one arriving just
        # after it (that commit landed during the check). Listening starts before the arm's
        # processes are found, so that the listening connection's server process is counted.
        with client.finish_signal() as signal:
            processes = self.service_processes(server_processes())
            usage = Usage(processes)
            bytes_before = self.redis.info("stats")["total_net_input_bytes"]
            # CPU is sampled once the last check finds every job finished and again after the
            # grace, and read off at the arm's end by interpolating from its start, as the
            # standalone arm's is read when its last request returns. Not while the burst
            # runs: a sample reads every process's counters, with CPU taken from the engines'
            # cores, which the standalone arm's burst does not pay. The sampling's own CPU is the
            # bench's, not the service's: it is taken out of the producer's (and the machine's).
            samples: list[tuple[float, dict[str, float]]] = []
            sampling = 0.0

            def sample() -> None:
                nonlocal sampling
                sampling_started = time.thread_time()
                used = usage.since_start()
                sampling += time.thread_time() - sampling_started
                used["producer"] -= sampling
                if MACHINE_CPU in used:
                    used[MACHINE_CPU] -= sampling
                samples.append((time.time(), used))

            started = time.time()
            ids = client.submit_many(jobs)
            bytes_after = self.redis.info("stats")["total_net_input_bytes"]
            pending = ids
            while pending:
                pending = client.unfinished(pending)
                if pending:
                    signal.wait(signal.check_interval(_POLL_SECONDS), jobs=len(pending))
            sample()
            signal.wait(_LAST_COMMIT_GRACE_SECONDS)
            heard = signal.last_heard
            # Before the listening connection closes: its server process then leaves the count.
            sample()
            samples.insert(0, (started, dict.fromkeys(samples[0][1], 0.0)))
        records = client.wait(ids)
        steps = _steps_between(steps_before, self.engine_step_totals(on_workers=True))
        # Without notifications (a database that sends none), the moment the last result was
        # recorded stands in (a failed job has no result; its engine finish does).
        last_recorded = max(_timestamp(record.recorded_at or record.finished_at)
                            for record in records)
        finished = heard or last_recorded
        cpu_by_role = {role: reading_at([(moment, used.get(role, 0.0))
                                         for moment, used in samples], finished)
                       for role in samples[-1][1]}
        steal = cpu_by_role.pop(STEAL)
        machine = cpu_by_role.pop(MACHINE_CPU, None)
        foreign = cpu_by_role.pop(FOREIGN_CPU, 0.0)
        runner_wait = cpu_by_role.pop(RUNNER_WAIT)
        if totals is not None:
            totals.bytes_enqueued.append(bytes_after - bytes_before)
            if heard is not None:
                totals.heard_after_recorded_ms.append((heard - last_recorded) * 1000)
            totals.failed += sum(r.status is not JobStatus.SUCCEEDED for r in records)
            totals.prompt_tokens += sum(r.prompt_tokens for r in records)
            totals.cached_tokens += sum(r.cached_tokens or 0 for r in records)
            for r in records:
                totals.shard_jobs[r.shard] += 1
                totals.admission_ms.append(
                    (_timestamp(r.started_at) - _timestamp(r.submitted_at)) * 1000)
                if r.recorded_at is not None:
                    totals.recording_lag_ms.append(
                        (_timestamp(r.recorded_at) - _timestamp(r.finished_at)) * 1000)
            totals.gc.add(self.ask_workers("take_gc_pauses", timeout=5))
            mismatched = sum(r.shard != planned
                             for r, planned in zip(records, shape.shard_of_job, strict=True))
            if mismatched:
                log.warning("%d jobs routed differently from the standalone plan", mismatched)
        shard_finishes = [(r.shard, _timestamp(r.finished_at)) for r in records]
        admitted = self.first_admission()
        return ArmResult(len(ids), finished - started,
                         sum(r.completion_tokens or 0 for r in records), cpu_by_role, steal,
                         head_seconds=admitted - started,
                         tail_seconds=max(0.0, finished - max(end for _, end in shard_finishes)),
                         runner_wait_seconds=runner_wait, machine_cpu_seconds=machine,
                         foreign_cpu_seconds=foreign,
                         shard_finish_spread_seconds=shard_finish_spread_seconds(shard_finishes),
                         mean_shard_seconds=mean_shard_seconds(shard_finishes, admitted),
                         **steps)

    def first_admission(self) -> float:
        """When the burst's first batch went to an engine, after its claim (as the standalone
        arm's head ends at its first request)."""
        admitted = [reading["admitted"] for reply in self.ask_workers("take_first_admission", 5)
                    for reading in reply.values() if reading.get("admitted") is not None]
        if not admitted:
            raise RuntimeError("no worker says when the burst's first batch reached its engine")
        return min(admitted)

    def run_standalone(self, jobs: list[dict[str, Any]], shape: TrialShape,
                       mode: str, record: bool = True) -> ArmResult:
        """Run the trial's jobs on the engines directly, on the same assignment as the service, and
        measure the arm as the service arm is measured (`record=False`: a warm-up, not kept)."""
        engines = self.engines
        if engines is None and not self.options.standalone_on_workers:
            raise RuntimeError("the standalone engines are not running")
        per_engine: list[list[tuple[str, str, dict[str, Any]]]] = [
            [] for _ in range(self.settings.shards)]
        for job, shard in zip(jobs, shape.shard_of_job, strict=True):
            per_engine[shard].append(as_job(job))
        on_workers = engines is None
        if on_workers:
            self.ask_workers("take_gc_pauses", timeout=5)
        steps_before = self.engine_step_totals(on_workers)
        time.sleep(_SETTLE_SECONDS)
        processes = self.standalone_processes(server_processes())
        usage = Usage(processes)
        run = (engines.run(per_engine, mode) if engines is not None
               else self.run_on_workers(per_engine, mode))
        cpu_by_role = usage.since_start()
        steps = _steps_between(steps_before, self.engine_step_totals(on_workers))
        steal = cpu_by_role.pop(STEAL)
        machine = cpu_by_role.pop(MACHINE_CPU, None)
        foreign = cpu_by_role.pop(FOREIGN_CPU, 0.0)
        runner_wait = cpu_by_role.pop(RUNNER_WAIT)
        if record:
            self.totals.standalone_prompt_tokens += run.prompt_tokens
            self.totals.standalone_cached_tokens += run.cached_tokens
            if on_workers:
                self.totals.standalone_gc.add(self.ask_workers("take_gc_pauses", timeout=5))
        return ArmResult(len(jobs), run.seconds, run.output_tokens, cpu_by_role, steal,
                         head_seconds=run.head_seconds, runner_wait_seconds=runner_wait,
                         machine_cpu_seconds=machine, foreign_cpu_seconds=foreign,
                         shard_finish_spread_seconds=shard_finish_spread_seconds(
                             enumerate(run.engines_finished)),
                         mean_shard_seconds=mean_shard_seconds(
                             enumerate(run.engines_finished), run.admitted),
                         **steps)


    def run_service_slot(self, client: Client, jobs: list[dict[str, Any]], shape: TrialShape,
                         mode: str) -> ArmResult:
        """The service arm, or in an A/A run (`standalone_twice`) the standalone arm again."""
        if self.options.standalone_twice:
            return self.run_standalone(jobs, shape, mode)
        if self.options.compare_admission:
            self.pace_admission(self.settings.admission_chunk, self.settings.admission_pause_ms)
        return self.run_service(client, jobs, shape, self.totals)

    def run_standalone_slot(self, client: Client, jobs: list[dict[str, Any]], shape: TrialShape,
                            mode: str) -> ArmResult:
        """The standalone arm, or in an admission A/B run (`compare_admission`) the service
        admitting each message at once, whose figures are kept apart from the paced
        service's."""
        if not self.options.compare_admission:
            return self.run_standalone(jobs, shape, mode)
        self.pace_admission(0, 0.0)
        return self.run_service(client, jobs, shape, self.all_at_once_totals)


def _steps_between(before: dict[str, float] | None, after: dict[str, float] | None
                   ) -> dict[str, float | None]:
    """A burst's engine steps and step tokens, as ArmResult's fields, from the totals read
    before and after it."""
    if before is None or after is None:
        return {"engine_steps": None, "engine_step_tokens": None}
    return {"engine_steps": after["steps"] - before["steps"],
            "engine_step_tokens": after["tokens"] - before["tokens"]}


def _timestamp(moment: datetime | None) -> float:
    if moment is None:
        raise ValueError("a finished job without timestamps")
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def run_bench(settings: Settings, options: BenchOptions,
              progress: Callable[[str], None] = print,
              pair_done: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the bench; `progress` gets its lines, `pair_done` a call after each pair."""
    settings = replace(settings, shards=options.shards,
                       routing=options.policy or settings.routing)
    settings.validate()
    check_options(settings, options)
    upgrade_to_head(settings.resolved_database_url)
    bench = Bench(settings, options, progress)
    progress(f"starting {settings.shards} service worker(s)"
             + ("" if options.standalone_on_workers else " and standalone engine(s)"))
    try:
        bench.start_engines()
        with Client(settings=bench.workers.settings) as client:
            return _run_pairs(bench, client, ADMISSION_MODES, pair_done)
    finally:
        bench.stop_engines()


def _run_pairs(bench: Bench, client: Client, modes: Sequence[str],
               pair_done: Callable[[], None]) -> dict[str, Any]:
    options, progress = bench.options, bench.progress
    calibration_jobs = bench_jobs(options, trial=0)
    calibration_shape = trial_shape(calibration_jobs, bench.prompts, bench.router)
    # Both arms run full bursts before the pairs (the standalone arm through calibration),
    # so neither meets the burst shape for the first time inside a measured pair.
    bench.run_service(client, calibration_jobs, calibration_shape, None)
    mode, calibration = options.standalone_admission or "all", {}
    if options.standalone_admission:
        bench.run_standalone(calibration_jobs, calibration_shape, mode, record=False)
    elif not options.compare_admission:
        mode, calibration = _calibrate(bench, calibration_jobs, calibration_shape, modes)

    pairs: list[Pair] = []
    ideal_rates: list[float] = []
    bytes_raw: list[int] = []
    for trial in range(1, options.trials + 1):
        jobs = bench_jobs(options, trial)
        shape = trial_shape(jobs, bench.prompts, bench.router)
        other_jobs, other_shape = jobs, shape
        if options.compare_admission:
            other_jobs = bench_jobs(options, options.trials + trial)
            other_shape = trial_shape(other_jobs, bench.prompts, bench.router)
        ideal_rates.append(shape.ideal_hit_rate)
        bytes_raw.append(shape.bytes_raw)
        if options.fresh_engines:
            progress(f"pair {trial}/{options.trials}: starting every engine afresh")
            bench.stop_engines()
            # The arm that runs first starts first: both orders come up as often.
            bench.start_engines(standalone_first=trial % 2 == 1)
            # A fresh engine's first burst is its first use of most of its memory.
            bench.run_service(client, calibration_jobs, calibration_shape, None)
            if not options.compare_admission:
                bench.run_standalone(calibration_jobs, calibration_shape, mode, record=False)
        service_first = trial % 2 == 0
        if service_first:
            service = bench.run_service_slot(client, jobs, shape, mode)
            standalone = bench.run_standalone_slot(client, other_jobs, other_shape, mode)
        else:
            standalone = bench.run_standalone_slot(client, other_jobs, other_shape, mode)
            service = bench.run_service_slot(client, jobs, shape, mode)
        pair = Pair(standalone, service, service_first)
        pairs.append(pair)
        first, second = arm_names(options)
        progress(f"pair {trial}/{options.trials}: {first} {service.requests_per_second:.2f} "
                 f"req/s, {second} {standalone.requests_per_second:.2f} req/s, "
                 f"ratio {pair.ratio:.4f}; CPU s/job {service.cpu_seconds_per_job:.4f} vs "
                 f"{standalone.cpu_seconds_per_job:.4f}, outside the engine "
                 f"{service.outside_engine_cpu_seconds_per_job:.4f} vs "
                 f"{standalone.outside_engine_cpu_seconds_per_job:.4f}; stolen by the "
                 f"hypervisor {service.steal_seconds:.2f} vs {standalone.steal_seconds:.2f} s"
                 + (f"; disturbed: other programs took over {DISTURBED_SHARE:.0%} of the "
                    "machine's CPU during an arm" if pair.disturbed else ""))
        pair_done()
    return _report(bench, pairs, mode, calibration, ideal_rates, bytes_raw)


def _calibrate(bench: Bench, jobs: list[dict[str, Any]], shape: TrialShape, modes: Sequence[str]
               ) -> tuple[str, dict[str, float]]:
    """The standalone arm's better admission style, and each style's rate."""
    # Each style runs twice, in mirrored order (A B B A), so that neither a drift of the
    # machine's speed nor one fast burst picks the style: a single burst per style once
    # picked interleaved admission, whose engine schedule is the worse one on reused documents.
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode in [*modes, *reversed(modes)]:
        rates[mode].append(bench.run_standalone(jobs, shape, mode,
                                                record=False).requests_per_second)
    calibration = {mode: sum(rate) / len(rate) for mode, rate in rates.items()}
    mode = max(calibration, key=calibration.__getitem__)
    bench.progress(f"standalone admission: {mode} ({calibration})")
    return mode, calibration


def _report(bench: Bench, pairs: list[Pair], mode: str, calibration: dict[str, float],
            ideal_rates: list[float], bytes_raw: list[int]) -> dict[str, Any]:
    totals, options = bench.totals, bench.options
    result: dict[str, Any] = {
        "workload": options.workload,
        "shards": bench.settings.shards,
        "policy": bench.settings.routing,
        "arms": "/".join(arm_names(options)),
        "trials": len(pairs),
        "jobs_per_trial": pairs[0].service.jobs,
        "output_tokens": options.output_tokens,
        "fresh_engines_per_pair": options.fresh_engines,
        "admission_chunk": bench.settings.admission_chunk,
        "admission_pause_ms": bench.settings.admission_pause_ms,
        **summarize_pairs(pairs),
        "ideal_hit_rate": sum(ideal_rates) / len(ideal_rates),
        "bytes_raw": sum(bytes_raw) // len(bytes_raw),
        **({} if options.compare_admission
           else _standalone_figures(totals, options, mode, calibration)),
        **({} if options.standalone_twice else _service_figures(totals)),
        **({"all_at_once": _service_figures(bench.all_at_once_totals)}
           if options.compare_admission else {}),
    }
    result["parity_checks"] = parity_checks(result)
    result["pairs"] = [_pair_figures(pair) for pair in pairs]
    if options.json_path:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(result, indent=2) + "\n")
    if options.plot_path:
        plot_pairs(result, options.plot_path)
    return result


def _standalone_figures(totals: _Totals, options: BenchOptions, mode: str,
                        calibration: dict[str, float]) -> dict[str, Any]:
    """What only the standalone arm has: its admission style, cache and collections."""
    return {
        "standalone_on_workers": options.standalone_on_workers,
        "standalone_admission": mode,
        "admission_calibration_rps": calibration,
        "standalone_hit_rate": (totals.standalone_cached_tokens
                                / max(totals.standalone_prompt_tokens, 1)),
        "standalone_gc_pause_max_ms": totals.standalone_gc.pause_max_ms,
        "standalone_gc_cpu_max_ms": totals.standalone_gc.cpu_max_ms,
        "standalone_gc_collections_by_generation":
            totals.standalone_gc.collections_by_generation,
    }


def _service_figures(totals: _Totals) -> dict[str, Any]:
    """What only the service arm has: its queue, database, routing and worker collections."""
    shard_jobs = totals.shard_jobs
    mean_jobs = sum(shard_jobs) / len(shard_jobs)
    return {
        "hit_rate": totals.cached_tokens / max(totals.prompt_tokens, 1),
        "shard_jobs": shard_jobs,
        "load_max_over_mean": max(shard_jobs) / mean_jobs if mean_jobs else 0.0,
        "bytes_enqueued": sum(totals.bytes_enqueued) // len(totals.bytes_enqueued),
        "gc_pause_max_ms": totals.gc.pause_max_ms,
        "gc_pause_max_ms_by_generation": totals.gc.pause_max_ms_by_generation,
        "gc_cpu_max_ms": totals.gc.cpu_max_ms,
        "gc_collections_by_generation": totals.gc.collections_by_generation,
        "gc_idle_pause_max_ms": totals.gc.idle_pause_max_ms,
        "gc_idle_collections": totals.gc.idle_collections,
        "queue_to_admission_ms": {"p50": percentile(totals.admission_ms, 0.5),
                                  "p99": percentile(totals.admission_ms, 0.99)},
        "engine_finish_to_recorded_ms": {
            "p50": percentile(totals.recording_lag_ms, 0.5),
            "p99": percentile(totals.recording_lag_ms, 0.99)} if totals.recording_lag_ms else None,
        "last_commit_heard_after_recorded_ms": {
            "p50": percentile(totals.heard_after_recorded_ms, 0.5),
            "max": max(totals.heard_after_recorded_ms)} if totals.heard_after_recorded_ms else None,
        "service_jobs_not_succeeded": totals.failed,
    }


def _pair_figures(pair: Pair) -> dict[str, Any]:
    """One pair as the JSON reports it: both arms side by side, so an outlier can be read."""
    return {
        "order": "service-first" if pair.service_first else "standalone-first",
        "ratio": pair.ratio,
        "body_ratio": pair.body_ratio,
        "shard_ratio": pair.shard_ratio,
        "standalone_rps": pair.standalone.requests_per_second,
        "service_rps": pair.service.requests_per_second,
        "standalone_tokens_per_s": pair.standalone.tokens_per_second,
        "service_tokens_per_s": pair.service.tokens_per_second,
        "standalone_cpu_s_per_job": pair.standalone.cpu_seconds_per_job,
        "service_cpu_s_per_job": pair.service.cpu_seconds_per_job,
        "standalone_outside_engine_cpu_s_per_job":
            pair.standalone.outside_engine_cpu_seconds_per_job,
        "service_outside_engine_cpu_s_per_job":
            pair.service.outside_engine_cpu_seconds_per_job,
        "standalone_outside_engine_cpu_ms_per_job_by_role":
            outside_engine_ms_per_job_by_role([pair.standalone]),
        "service_outside_engine_cpu_ms_per_job_by_role":
            outside_engine_ms_per_job_by_role([pair.service]),
        "standalone_steal_s": pair.standalone.steal_seconds,
        "service_steal_s": pair.service.steal_seconds,
        "standalone_unaccounted_cpu_s": pair.standalone.unaccounted_cpu_seconds,
        "service_unaccounted_cpu_s": pair.service.unaccounted_cpu_seconds,
        "standalone_foreign_cpu_s": pair.standalone.bounded_foreign_cpu_seconds,
        "service_foreign_cpu_s": pair.service.bounded_foreign_cpu_seconds,
        "disturbed": pair.disturbed,
        "standalone_head_ms": pair.standalone.head_seconds * 1000,
        "service_head_ms": pair.service.head_seconds * 1000,
        "service_tail_ms": pair.service.tail_seconds * 1000,
        "standalone_runner_wait_ms": pair.standalone.runner_wait_seconds * 1000,
        "service_runner_wait_ms": pair.service.runner_wait_seconds * 1000,
        "standalone_engine_steps": pair.standalone.engine_steps,
        "service_engine_steps": pair.service.engine_steps,
        "standalone_engine_step_tokens": pair.standalone.engine_step_tokens,
        "service_engine_step_tokens": pair.service.engine_step_tokens,
        "standalone_shard_finish_spread_ms": milliseconds(
            pair.standalone.shard_finish_spread_seconds),
        "service_shard_finish_spread_ms": milliseconds(pair.service.shard_finish_spread_seconds),
    }


def plot_pairs(result: dict[str, Any], path: Path) -> None:
    """Per-pair throughput ratio and CPU-seconds per job of both arms, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    pairs = result["pairs"]
    # The service arm's slot, then the standalone arm's (either may hold something else).
    first, second = result["arms"].split("/")
    index = list(range(1, len(pairs) + 1))
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    left.plot(index, [pair["ratio"] for pair in pairs], "o-", label=f"{first} / {second}")
    left.axhline(0.99, color="red", linestyle="--", label="0.99")
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xlabel("pair")
    left.set_ylabel("throughput ratio")
    low, high = result["median_ratio_interval_95"]
    left.set_title(f"{result['workload']}, {result['shards']} shard(s): "
                   f"median {result['median_ratio']:.4f} ({low:.3f}-{high:.3f})")
    left.legend()
    width = 0.4
    right.bar([i - width / 2 for i in index], [p["standalone_cpu_s_per_job"] for p in pairs],
              width, label=second)
    right.bar([i + width / 2 for i in index], [p["service_cpu_s_per_job"] for p in pairs],
              width, label=first)
    right.set_xlabel("pair")
    right.set_ylabel("CPU seconds per job")
    right.set_title(f"cpu_ratio {result['cpu_ratio']:.4f}")
    right.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
