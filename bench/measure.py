"""Pure arithmetic of the benchmark: percentiles, paired ratios, CPU accounting, cache rates."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear-interpolated percentile (`fraction` in [0, 1]) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    return percentile(values, 0.5)


# Resamples behind a bootstrap interval, and the seed that makes a report reproducible.
BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 5


def _seeded_draws(values: Sequence[float], size: int, resamples: int
                  ) -> Iterator[list[float]]:
    """`resamples` samples of `size` values drawn with replacement, the same on every call."""
    draw = random.Random(BOOTSTRAP_SEED).choices
    for _ in range(resamples):
        yield draw(values, k=size)


def median_interval(values: Sequence[float], level: float = 0.95,
                    resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """A percentile-bootstrap interval for the median of `values`: how far the median of
    this many pairs could have landed on another run of the same noise. A ratio whose
    interval holds 0.99 has not been told apart from it."""
    if not values:
        raise ValueError("an interval needs at least one value")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    medians = [median(sample) for sample in _seeded_draws(values, len(values), resamples)]
    tail = (1.0 - level) / 2
    return percentile(medians, tail), percentile(medians, 1.0 - tail)


# A process in a CPU snapshot: its PID and its part in the arm, such as "producer",
# "worker", "redis", "postgres", or ENGINE_ROLE for vLLM's engine processes.
ProcessKey = tuple[int, str]
ENGINE_ROLE = "engine"


def cpu_seconds_by_role(before: Mapping[ProcessKey, float],
                        after: Mapping[ProcessKey, float]) -> dict[str, float]:
    """CPU seconds spent between two snapshots of {process: cumulative CPU seconds}, summed
    per role. A process that appeared in between counts from zero; one that vanished is not
    counted (its time after the first snapshot cannot be known)."""
    used: dict[str, float] = {}
    for (pid, role), total in after.items():
        used[role] = used.get(role, 0.0) + total - before.get((pid, role), 0.0)
    return used


def reading_at(samples: Sequence[tuple[float, float]], moment: float) -> float:
    """A cumulative reading (such as CPU seconds) at `moment`, interpolated linearly between
    the (time, reading) samples around it, or the nearest sample outside them. Lets an arm's
    CPU be counted up to the moment its last job finished rather than to the poll that
    noticed: the engine's idle workers spin on their cores for a while after the last step,
    and that spin would otherwise be charged to the arm that polls."""
    if not samples:
        raise ValueError("reading_at needs at least one sample")
    ordered = sorted(samples)
    if moment <= ordered[0][0]:
        return ordered[0][1]
    for (start, low), (end, high) in itertools.pairwise(ordered):
        if moment <= end:
            share = (moment - start) / (end - start) if end > start else 1.0
            return low + (high - low) * share
    return ordered[-1][1]


def _aggregate_cpu_ticks(proc_stat: str) -> list[int]:
    """The clock-tick counters of /proc/stat's aggregate `cpu` line, summed over cores:
    user, nice, system, idle, iowait, irq, softirq, steal and on (older kernels stop early)."""
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return [int(field) for field in fields[1:]]
    raise ValueError("no aggregate cpu line in /proc/stat text")


def steal_seconds(proc_stat: str, ticks_per_second: float) -> float:
    """CPU time the hypervisor gave to other guests, summed over cores, from the text of
    /proc/stat. On a virtual machine this time is lost to the wall clock of whichever arm
    runs, but never shows in its CPU time."""
    ticks = _aggregate_cpu_ticks(proc_stat)
    return ticks[7] / ticks_per_second if len(ticks) > 7 else 0.0


def busy_seconds(proc_stat: str, ticks_per_second: float) -> float:
    """CPU time the cores spent running anything (user, nice, system, irq and softirq time;
    a guest's time is already in user), summed over cores, from the text of /proc/stat:
    what every process and the kernel took, whether or not an arm's accounting names them."""
    ticks = _aggregate_cpu_ticks(proc_stat)
    return sum(ticks[index] for index in (0, 1, 2, 5, 6) if index < len(ticks)
               ) / ticks_per_second


def schedstat_wait_ns(schedstat: str) -> int:
    """A thread's cumulative time runnable but waiting for a core, in nanoseconds, from the
    text of its /proc/<pid>/task/<tid>/schedstat (run time, wait time, time slices)."""
    fields = schedstat.split()
    if len(fields) != 3:
        raise ValueError(f"not a schedstat line: {schedstat!r}")
    return int(fields[1])


def _last_finish_by_shard(finishes: Iterable[tuple[int, float]]) -> dict[int, float]:
    last: dict[int, float] = {}
    for shard, finished in finishes:
        last[shard] = max(finished, last.get(shard, finished))
    return last


def shard_finish_spread_seconds(finishes: Iterable[tuple[int, float]]) -> float:
    """From the first shard's last finish to the last shard's, given (shard, finish) of every
    job or engine: while it lasts, the cores of the shards already done have nothing to run."""
    last = _last_finish_by_shard(finishes)
    return max(last.values()) - min(last.values())


def mean_shard_seconds(finishes: Iterable[tuple[int, float]], admitted: float) -> float:
    """How long the shards ran on average, from the arm's first job handed to an engine to
    each shard's last finish, given (shard, finish) of every job or engine: the engines' pace
    apart from the head, the tail, and how far apart the shards finish."""
    last = _last_finish_by_shard(finishes)
    return sum(finished - admitted for finished in last.values()) / len(last)


def wait_seconds(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """Seconds threads waited for a core between two readings of {thread ID: cumulative
    wait in ns}. A thread born in between counts from zero; one that ended is not counted."""
    return sum(wait - before.get(thread, 0) for thread, wait in after.items()) / 1e9


# An arm is disturbed when other programs on the machine took more than this share of its CPU
# while the arm ran: its time then says more about them than about the arm. The bound sits
# above what a quiet machine's own daemons take and well below what another program running
# beside a burst takes (`docs/benchmarks.md`).
DISTURBED_SHARE = 0.02


@dataclass(frozen=True)
class ArmResult:
    """One arm of one trial."""

    jobs: int
    seconds: float
    output_tokens: int
    # CPU seconds of every process the arm used, summed per role (see ProcessKey).
    cpu_by_role: Mapping[str, float]
    # CPU time stolen by the hypervisor while the arm ran (0 on bare metal).
    steal_seconds: float = 0.0
    # CPU time the whole machine spent while the arm ran (`busy_seconds`); None where it
    # could not be read.
    machine_cpu_seconds: float | None = None
    # CPU time the other programs on the machine took while the arm ran (processes outside
    # both arms, the servers and the kernel), as read; None where it could not be read.
    # `bounded_foreign_cpu_seconds` is what the reports use.
    foreign_cpu_seconds: float | None = None
    # From the arm's start to its first job handed to an engine: the burst's head, when the
    # engines wait for tokenizing (both arms) and for recording, publishing and claiming
    # (the service only).
    head_seconds: float = 0.0
    # From the last job's end in an engine to the arm's end: the burst's tail, in which the
    # service records the last results and its producer hears of them (0 for the standalone
    # arm, which ends when its last request returns).
    tail_seconds: float = 0.0
    # Time the engine's model-running threads spent runnable but without a core while the arm
    # ran: on a host whose cores the engine keeps busy, what other processes' CPU cost it.
    runner_wait_seconds: float = 0.0
    # The engines' scheduler steps in the arm's burst and the tokens those steps computed
    # (`jobsvc.bench.probes.engine_step_totals`); None where they could not be read.
    engine_steps: float | None = None
    engine_step_tokens: float | None = None
    # `shard_finish_spread_seconds` of the arm's burst; None where it could not be read.
    shard_finish_spread_seconds: float | None = None
    # `mean_shard_seconds` of the arm's burst; None where it could not be read.
    mean_shard_seconds: float | None = None

    @property
    def cpu_seconds(self) -> float:
        """CPU the arm took, every role together."""
        return sum(self.cpu_by_role.values())

    @property
    def outside_engine_cpu_seconds(self) -> float:
        """The steady part of the arm's CPU: vLLM's engine processes spin-wait on their cores
        between steps, so their CPU time follows the wall clock, noise included."""
        return sum(seconds for role, seconds in self.cpu_by_role.items()
                   if role != ENGINE_ROLE)

    @property
    def unaccounted_cpu_seconds(self) -> float | None:
        """The machine's CPU that none of the arm's processes spent: the kernel's threads and
        interrupts, the machine's daemons, and processes that came and went during the arm
        (a database server's worker, say). An arm that costs the engine time it does not
        account for shows it here."""
        if self.machine_cpu_seconds is None:
            return None
        return self.machine_cpu_seconds - self.cpu_seconds

    @property
    def bounded_foreign_cpu_seconds(self) -> float | None:
        """Other programs' CPU, at most the unaccounted CPU: a program that reaps a child adds
        the child's whole life at once, but none of them can have spent more of the arm's
        time than the machine spent outside the arm's processes."""
        foreign, unaccounted = self.foreign_cpu_seconds, self.unaccounted_cpu_seconds
        if foreign is None or unaccounted is None:
            return foreign
        return max(0.0, min(foreign, unaccounted))

    @property
    def disturbed(self) -> bool:
        """True when other programs took more than DISTURBED_SHARE of the machine's CPU while
        the arm ran (False where either was not read)."""
        machine, foreign = self.machine_cpu_seconds, self.bounded_foreign_cpu_seconds
        return machine is not None and foreign is not None and foreign > DISTURBED_SHARE * machine

    @property
    def requests_per_second(self) -> float:
        """The arm's throughput in jobs."""
        return self.jobs / self.seconds

    @property
    def tokens_per_second(self) -> float:
        """The arm's throughput in output tokens."""
        return self.output_tokens / self.seconds

    @property
    def cpu_seconds_per_job(self) -> float:
        """CPU per job, every role together: what the arms compare on."""
        return self.cpu_seconds / self.jobs

    @property
    def outside_engine_cpu_seconds_per_job(self) -> float:
        """CPU per job spent outside the engines: the cost the service adds."""
        return self.outside_engine_cpu_seconds / self.jobs


@dataclass(frozen=True)
class Pair:
    """One standalone arm and one service arm run back to back, in the order recorded, so their
    ratio cancels the drift of the host between pairs."""

    standalone: ArmResult
    service: ArmResult
    service_first: bool

    @property
    def ratio(self) -> float:
        """Service throughput as a share of standalone's (1.0 = parity)."""
        return self.service.requests_per_second / self.standalone.requests_per_second

    @property
    def body_ratio(self) -> float:
        """`ratio` with each arm's head taken out: how the engines kept pace once they had
        work, apart from how soon they got it."""
        return ((self.standalone.seconds - self.standalone.head_seconds)
                / (self.service.seconds - self.service.head_seconds))

    @property
    def shard_ratio(self) -> float | None:
        """The standalone arm's mean shard time over the service's (`mean_shard_seconds`):
        how fast the engines ran once they had work, shard by shard, apart from the heads,
        the service's tail and which shard happened to finish last. None where an arm lacks
        it."""
        standalone, service = self.standalone.mean_shard_seconds, self.service.mean_shard_seconds
        if standalone is None or service is None:
            return None
        return standalone / service

    @property
    def disturbed(self) -> bool:
        """Either arm disturbed: the pair's ratio may be the disturbance's, not the service's."""
        return self.standalone.disturbed or self.service.disturbed


def ratio_summary(ratios: Sequence[float]) -> dict[str, Any]:
    """Where a set of pair ratios lies: their median with its bootstrap interval, how many
    pairs the service was behind in, and the extremes. The same for one run's pairs and for
    the pairs of several runs pooled."""
    return {
        "median_ratio": median(ratios),
        "median_ratio_interval_95": list(median_interval(ratios)),
        "pairs_behind": sum(ratio < 1.0 for ratio in ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


# What a run must show to hold parity: the median pair at 99 % of standalone or better, no
# pair below 95 %, at most 1 % more CPU per job, what travels to Redis on a reused-document
# burst at least 16 times smaller than raw, and no collection longer than 4 ms while a worker
# has batches in flight.
PARITY_MEDIAN_RATIO = 0.99
PARITY_MIN_RATIO = 0.95
PARITY_CPU_RATIO = 1.01
PARITY_COMPRESSION = 16.0
PARITY_GC_PAUSE_MS = 4.0


def parity_checks(report: Mapping[str, Any]) -> dict[str, bool | None]:
    """Which of the parity bars a bench report clears, by the figure each reads. The
    compression bar holds only for the `reuse` workload (None elsewhere), and a figure a run
    leaves out (an A/A run has no service, a run with no worker reading no pauses) is None."""
    compression = None
    if report.get("workload") == "reuse" and report.get("bytes_enqueued"):
        compression = report["bytes_raw"] / report["bytes_enqueued"] >= PARITY_COMPRESSION
    pauses = report.get("gc_pause_max_ms")
    return {
        "median_ratio": report["median_ratio"] >= PARITY_MEDIAN_RATIO,
        "min_ratio": report["min_ratio"] >= PARITY_MIN_RATIO,
        "cpu_ratio": report["cpu_ratio"] <= PARITY_CPU_RATIO,
        "bytes_enqueued": compression,
        "gc_pause_max_ms": (all(pause <= PARITY_GC_PAUSE_MS for pause in pauses.values())
                            if pauses else None),
    }


def chance_to_clear(ratios: Sequence[float], pairs_per_run: int,
                    resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, float]:
    """How often a run of `pairs_per_run` pairs, drawn from these pair ratios, would clear
    the median bar, the min bar and both. Drawn from an A/A run's pairs (standalone against
    itself) it is the most any service, however cheap, could expect of that host."""
    if not ratios:
        raise ValueError("the chance to clear the bars needs at least one pair")
    if pairs_per_run < 1:
        raise ValueError(f"a run has at least one pair, got {pairs_per_run}")
    median_cleared = min_cleared = both_cleared = 0
    for run in _seeded_draws(ratios, pairs_per_run, resamples):
        median_ok = median(run) >= PARITY_MEDIAN_RATIO
        min_ok = min(run) >= PARITY_MIN_RATIO
        median_cleared += median_ok
        min_cleared += min_ok
        both_cleared += median_ok and min_ok
    return {"median_ratio": median_cleared / resamples, "min_ratio": min_cleared / resamples,
            "both": both_cleared / resamples}


def summarize_pairs(pairs: Sequence[Pair]
                    ) -> dict[str, float | list[float] | dict[str, float]]:
    """The pairs' ratios and CPU figures as the bench report shows them."""
    service_cpu = _per_job(pairs, "service", "cpu_seconds")
    standalone_cpu = _per_job(pairs, "standalone", "cpu_seconds")
    service_outside = _per_job(pairs, "service", "outside_engine_cpu_seconds")
    standalone_outside = _per_job(pairs, "standalone", "outside_engine_cpu_seconds")
    return {
        **ratio_summary([pair.ratio for pair in pairs]),
        "standalone_cpu_seconds_per_job": standalone_cpu,
        "service_cpu_seconds_per_job": service_cpu,
        "cpu_ratio": service_cpu / standalone_cpu,
        "standalone_outside_engine_cpu_seconds_per_job": standalone_outside,
        "service_outside_engine_cpu_seconds_per_job": service_outside,
        # What the service adds outside the engine, as a share of all standalone CPU: the
        # overhead that wall-clock noise cannot hide or fake.
        "added_cpu_share": (service_outside - standalone_outside) / standalone_cpu,
        # Time the hypervisor took from the machine during each arm: wall-clock noise that
        # neither arm's CPU accounting sees.
        "standalone_steal_seconds_per_job": _per_job(pairs, "standalone", "steal_seconds"),
        "service_steal_seconds_per_job": _per_job(pairs, "service", "steal_seconds"),
        # The machine's CPU outside each arm's processes, and the part of it other programs
        # took, in ms per job.
        "unaccounted_cpu_ms_per_job": _arm_ms_per_job(pairs, "unaccounted_cpu_seconds"),
        "foreign_cpu_ms_per_job": _arm_ms_per_job(pairs, "bounded_foreign_cpu_seconds"),
        # The pairs (numbered from 1, as the bench's log numbers them) with a disturbed arm:
        # the figures above include them, and a reader can weigh them.
        "disturbed_pairs": [number for number, pair in enumerate(pairs, 1) if pair.disturbed],
        # The median head of each arm's bursts; the service's extra head as a share of its
        # burst (the engines idle for that long while the burst is already timed) and the
        # ratio without the heads, each a median over pairs.
        "head_ms": {arm: median([getattr(pair, arm).head_seconds * 1000 for pair in pairs])
                    for arm in ("standalone", "service")},
        "extra_head_share": median([
            (pair.service.head_seconds - pair.standalone.head_seconds) / pair.service.seconds
            for pair in pairs]),
        "body_ratio": median([pair.body_ratio for pair in pairs]),
        "shard_ratio": _median_or_none([pair.shard_ratio for pair in pairs]),
        # The median time per burst the engines' model-running threads waited for a core, each
        # arm: the service's extra is what its own processes took from the engines.
        "runner_wait_ms": {arm: median([getattr(pair, arm).runner_wait_seconds * 1000
                                        for pair in pairs])
                           for arm in ("standalone", "service")},
        # The median steps of each arm's bursts and the tokens they computed: equal when the
        # engines scheduled both arms' jobs alike, so that any difference in time is speed.
        "engine_steps": _arm_medians(pairs, "engine_steps"),
        "engine_step_tokens": _arm_medians(pairs, "engine_step_tokens"),
        # How long before the burst's end its first shard had finished, at the median: with
        # shards on cores of their own, time in which only the last shard's cores work.
        "shard_finish_spread_ms": {
            arm: milliseconds(seconds)
            for arm, seconds in _arm_medians(pairs, "shard_finish_spread_seconds").items()},
        "service_tail_ms": {"p50": median([pair.service.tail_seconds * 1000 for pair in pairs]),
                            "max": max(pair.service.tail_seconds * 1000 for pair in pairs)},
        # Where each arm's CPU outside the engine went, in milliseconds per job.
        "standalone_outside_engine_cpu_ms_per_job_by_role": _by_role(pairs, "standalone"),
        "service_outside_engine_cpu_ms_per_job_by_role": _by_role(pairs, "service"),
    }


def milliseconds(seconds: float | None) -> float | None:
    """`seconds` in milliseconds, None kept."""
    return None if seconds is None else seconds * 1000


def _median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of an optional figure; None where a pair lacks it."""
    present = [value for value in values if value is not None]
    return median(present) if len(present) == len(values) else None


def _arm_medians(pairs: Sequence[Pair], figure: str) -> dict[str, float | None]:
    """Each arm's median of an optional figure; None for an arm where a pair lacks it."""
    return {arm: _median_or_none([getattr(getattr(pair, arm), figure) for pair in pairs])
            for arm in ("standalone", "service")}


def _arm_ms_per_job(pairs: Sequence[Pair], figure: str) -> dict[str, float | None]:
    """Each arm's optional CPU figure in milliseconds per job over all pairs; None for an arm
    where a pair lacks it."""
    return {arm: None if any(getattr(getattr(pair, arm), figure) is None for pair in pairs)
            else _per_job(pairs, arm, figure) * 1000
            for arm in ("standalone", "service")}


def _by_role(pairs: Sequence[Pair], arm: str) -> dict[str, float]:
    return outside_engine_ms_per_job_by_role([getattr(pair, arm) for pair in pairs])


def outside_engine_ms_per_job_by_role(results: Sequence[ArmResult]) -> dict[str, float]:
    """Where these runs' CPU outside the engine went, in milliseconds per job by role: per
    pair it tells which process an outlying burst spent more in."""
    jobs = sum(result.jobs for result in results)
    totals: dict[str, float] = {}
    for result in results:
        for role, seconds in result.cpu_by_role.items():
            if role != ENGINE_ROLE:
                totals[role] = totals.get(role, 0.0) + seconds
    return {role: round(seconds / jobs * 1000, 3) for role, seconds in sorted(totals.items())}


def _per_job(pairs: Sequence[Pair], arm: str, seconds: str) -> float:
    """CPU seconds of one kind per job, over all pairs, for one arm."""
    results = [getattr(pair, arm) for pair in pairs]
    return (sum(getattr(result, seconds) for result in results)
            / sum(result.jobs for result in results))


def ideal_hit_rate(jobs: Sequence[tuple[str, int, int]], block_size: int) -> float:
    """Share of prompt tokens a perfect prefix cache could serve. `jobs` holds
    (document ID, document tokens, prompt tokens) per job: every job after the first on a
    document finds the document's full blocks cached."""
    seen: set[str] = set()
    cached = total = 0
    for document, document_tokens, prompt_tokens in jobs:
        if document in seen:
            cached += document_tokens // block_size * block_size
        seen.add(document)
        total += prompt_tokens
    return cached / total if total else 0.0
