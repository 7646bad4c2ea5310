"""What a little CPU beside the engine costs it: standalone bursts on one engine, alternately
alone and beside a co-runner process that wakes every period and spins for a slice (as the
service's own processes wake beside the engine), with the co-runner's CPU measured. With
`--touch-mib`, the co-runner spends its slices writing to a buffer of that size instead of
spinning in place, so that it also evicts the engine's data from the caches it shares.

`amplification` is the burst's extra wall time over the co-runner's CPU spread evenly over
the engine's cores: 1 if the co-runner only took its own share, more if every core it
preempts holds up the engine's other threads too (OpenMP's threads meet at a barrier in every
layer, so a step waits for the slowest). Prints JSON.

    python -m jobsvc.bench.interference --pairs 8 --slice-ms 2 --period-ms 10
    python -m jobsvc.bench.interference --pairs 8 --slice-ms 2 --period-ms 10 --touch-mib 32
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

import numpy
import psutil

from jobsvc.bench.options import BenchOptions, bench_jobs, shard_devices
from jobsvc.bench.standalone import Job, StandaloneEngines, as_job
from jobsvc.settings import Settings

# A touching co-runner writes one byte per cache line, this many bytes of its buffer at a time
# between looks at the clock.
_TOUCH_CHUNK_BYTES = 256 * 1024
_CACHE_LINE_BYTES = 64


def spin(slice_seconds: float, period_seconds: float, touch_bytes: int, stop: Any) -> None:
    """Wake every period and burn one slice of CPU, until told to stop: in place, or walking
    on through a buffer of `touch_bytes` from where the last slice stopped."""
    buffer = numpy.zeros(touch_bytes, dtype=numpy.uint8)
    offset = 0
    while not stop.is_set():
        woke = time.perf_counter()
        while time.perf_counter() - woke < slice_seconds:
            if touch_bytes:
                buffer[offset:offset + _TOUCH_CHUNK_BYTES:_CACHE_LINE_BYTES] += 1
                offset = (offset + _TOUCH_CHUNK_BYTES) % touch_bytes
        stop.wait(max(0.0, period_seconds - (time.perf_counter() - woke)))


def run_burst(engines: Any, jobs: list[tuple[str, str, dict[str, Any]]], mode: str,
              slice_seconds: float | None, period_seconds: float, touch_bytes: int
              ) -> dict[str, float]:
    """One burst's wall time, and the co-runner's CPU over it (none if `slice_seconds` is
    None)."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    corunner = None
    if slice_seconds is not None:
        corunner = context.Process(target=spin,
                                   args=(slice_seconds, period_seconds, touch_bytes, stop))
        corunner.start()
        time.sleep(0.5)  # past the interpreter's start-up
    cpu_before = _cpu(corunner)
    run = engines.run([jobs], mode)
    cpu = _cpu(corunner) - cpu_before
    if corunner is not None:
        stop.set()
        corunner.join()
    time.sleep(1.0)
    return {"seconds": run.seconds, "corunner_cpu_s": cpu}


def _cpu(process: Any) -> float:
    if process is None:
        return 0.0
    times = psutil.Process(process.pid).cpu_times()
    return times.user + times.system


def main() -> None:
    """`python -m jobsvc.bench.interference`: bursts alone and beside the co-runner, in pairs,
    as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--slice-ms", type=float, default=2.0)
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--touch-mib", type=float, default=0.0,
                        help="size of the buffer the co-runner writes to (0: it spins in place)")
    parser.add_argument("--mode", default="all", help="standalone admission: all or staggered")
    args = parser.parse_args()
    if args.touch_mib < 0:
        parser.error("--touch-mib must be 0 or more")
    # Standard output is for the JSON; the engine logs to standard error.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    settings = Settings.from_env(shards=1)
    touch_bytes = int(args.touch_mib * 1024 * 1024)
    cores = len(os.sched_getaffinity(0))
    engines = StandaloneEngines(settings, shard_devices(settings.shards))
    options = BenchOptions(workload="reuse")

    def jobs_of(trial: int) -> list[Job]:
        return [as_job(job, settings.job_limits) for job in bench_jobs(options, trial)]

    try:
        run_burst(engines, jobs_of(0), args.mode, None, 0.0, 0)  # warm-up
        pairs = []
        for trial in range(1, args.pairs + 1):
            jobs = jobs_of(trial)
            order = [None, args.slice_ms / 1000] if trial % 2 else [args.slice_ms / 1000, None]
            runs = {"alone" if slice_seconds is None else "beside":
                    run_burst(engines, jobs, args.mode, slice_seconds, args.period_ms / 1000,
                              touch_bytes)
                    for slice_seconds in order}
            extra = runs["beside"]["seconds"] - runs["alone"]["seconds"]
            share = runs["beside"]["corunner_cpu_s"] / cores
            pairs.append({"alone_s": runs["alone"]["seconds"],
                          "beside_s": runs["beside"]["seconds"],
                          "corunner_cpu_s": runs["beside"]["corunner_cpu_s"],
                          "amplification": extra / share if share else None})
    finally:
        engines.shutdown()
    amplifications = [pair["amplification"] for pair in pairs]
    print(json.dumps({
        "slice_ms": args.slice_ms, "period_ms": args.period_ms, "touch_mib": args.touch_mib,
        "mode": args.mode,
        "cores": cores, "pairs": pairs,
        "median_amplification": statistics.median(amplifications),
        "median_slowdown": statistics.median(p["beside_s"] / p["alone_s"] for p in pairs),
    }, indent=2))


if __name__ == "__main__":
    main()
