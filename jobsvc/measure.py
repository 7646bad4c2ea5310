"""Pure arithmetic of the benchmark: percentiles, paired ratios, CPU accounting, cache rates."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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
    return percentile(values, 0.5)


def cpu_seconds_used(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds spent between two snapshots of {pid: cumulative CPU seconds}. A process
    that appeared in between counts from zero; one that vanished is not counted (its time
    after the first snapshot cannot be known)."""
    return sum(total - before.get(pid, 0.0) for pid, total in after.items())


@dataclass(frozen=True)
class ArmResult:
    """One arm of one trial."""

    jobs: int
    seconds: float
    output_tokens: int
    cpu_seconds: float

    @property
    def requests_per_second(self) -> float:
        return self.jobs / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cpu_seconds_per_job(self) -> float:
        return self.cpu_seconds / self.jobs


@dataclass(frozen=True)
class Pair:
    standalone: ArmResult
    service: ArmResult
    service_first: bool

    @property
    def ratio(self) -> float:
        """Service throughput as a share of standalone's (1.0 = parity)."""
        return self.service.requests_per_second / self.standalone.requests_per_second


def summarize_pairs(pairs: Sequence[Pair]) -> dict[str, float]:
    ratios = [pair.ratio for pair in pairs]
    service_cpu = sum(pair.service.cpu_seconds for pair in pairs) / sum(
        pair.service.jobs for pair in pairs)
    standalone_cpu = sum(pair.standalone.cpu_seconds for pair in pairs) / sum(
        pair.standalone.jobs for pair in pairs)
    return {
        "median_ratio": median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "standalone_cpu_seconds_per_job": standalone_cpu,
        "service_cpu_seconds_per_job": service_cpu,
        "cpu_ratio": service_cpu / standalone_cpu,
    }


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
