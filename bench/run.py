"""`jobsvc bench`: finite bursts through the service and through standalone vLLM, in
alternated pairs, with throughput, CPU-seconds per job and cache figures as JSON. By default
the standalone arm drives the service workers' own engines directly, so that both arms of a
pair meet the same engine instance.

Both arms share the machine, the engine configuration, the shard count, the documents and the
document-to-engine assignment; each pair reverses the order of the previous one, and every
trial starts from a cold prefix cache. Wall-clock throughput on a shared 2-core machine varies
by several percent between runs; CPU-seconds per job, summed over every process an arm uses,
is the steadier measure of what the service costs on top of the engine.

This module drives the pairs: it starts the engines, runs and measures each arm's bursts, and
hands the pairs to `run_report`; what a run does, and on which jobs, is set in `options`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import psutil
import redis

from jobsvc.bench.measure import (
    DISTURBED_SHARE,
    ArmResult,
    Pair,
    ideal_hit_rate,
    mean_shard_seconds,
    reading_at,
    shard_finish_spread_seconds,
)
from jobsvc.bench.options import BenchOptions, arm_names, bench_jobs, check_options, shard_devices
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
from jobsvc.bench.report import Totals, run_report
from jobsvc.bench.standalone import ADMISSION_MODES, StandaloneEngines, StandaloneRun, as_job
from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.migrate import upgrade_to_head
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.job_cost import RoutingJob, decode_load
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.prefix import document_keys
from jobsvc.routing.router import Router, make_router, reset_routing_state
from jobsvc.settings import Settings
from jobsvc.transport import make_celery
from jobsvc.wire import JobStatus

log = logging.getLogger(__name__)

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
        self.router = make_router(self.redis, LoadLedger(self.redis), settings)
        self.totals = Totals(shard_jobs=[0] * settings.shards)
        # The service admitting each message at once, in an admission A/B run.
        self.all_at_once_totals = Totals(shard_jobs=[0] * settings.shards)

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
                    totals: Totals | None) -> ArmResult:
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
        limits = self.settings.job_limits
        for job, shard in zip(jobs, shape.shard_of_job, strict=True):
            per_engine[shard].append(as_job(job, limits))
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
    return run_report(bench.settings, options, bench.totals, bench.all_at_once_totals, pairs, mode,
                      calibration, ideal_rates, bytes_raw)


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

