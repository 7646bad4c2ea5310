"""Worker start-up: bind the device before vLLM is imported, then run a threads-pool Celery
worker that consumes exactly one shard queue. (vLLM starts processes of its own, which
Celery's prefork children, being daemonic, may not do.)"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from jobsvc.errors import ConfigurationError, translated
from jobsvc.health import SeenWorker, read_heartbeat
from jobsvc.keys import queue_name
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.workers.engine import is_cpu_build
from jobsvc.workers.engine_reaper import signal_on_parent_death

log = logging.getLogger(__name__)

# Where the kernel says whether it schedules each session as one group (autogroups), and
# where a session's group takes its priority.
_AUTOGROUPS_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")
_OWN_AUTOGROUP = Path("/proc/self/autogroup")


def bind_device(settings: Settings, device: str | None) -> None:
    """On GPU hosts `device` is a GPU index for CUDA_VISIBLE_DEVICES; on CPU hosts a list of
    cores for vLLM's OpenMP threads (e.g. "0-1")."""
    if is_cpu_build():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_gb))
        if device:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = device
    elif device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    if Path(settings.model).is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Seconds between a worker's Celery event heartbeats (jobsvc's own are `jobsvc.health`'s).
# Celery sends them whether or not anything watches, every 2 s by default, each through a
# Redis client built for the publish: the most frequent work of an idle worker's consumer
# thread, on cores the engine needs. Monitors (Flower) read the interval off each heartbeat
# and keep the worker online for twice as long.
CELERY_HEARTBEAT_SECONDS = 10


def cpu_cores(device: str) -> set[int]:
    """The cores a CPU device names, in vLLM's syntax: "0-1", "0,2", or one list per
    tensor-parallel rank joined by "|"."""
    cores: set[int] = set()
    for part in device.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last or first) + 1)
        except ValueError:
            span = range(0)
        if not span:
            raise ConfigurationError(f"--device {device!r} is not a list of CPU cores")
        cores.update(span)
    return cores


def keep_to_device(device: str | None) -> None:
    """On CPU hosts, keep the whole shard on its cores: the worker's threads and vLLM's
    scheduler process, which spin-waits on sched_yield while the model runs, as well as the
    model's threads (which vLLM binds itself). Left free, they run on another shard's cores
    and slow that engine, so that shards which share out a burst evenly still finish apart."""
    if device and is_cpu_build():
        try:
            os.sched_setaffinity(0, cpu_cores(device))
        except OSError:
            raise ConfigurationError(
                f"--device {device!r} names cores this machine does not offer "
                f"(it has {sorted(os.sched_getaffinity(0))})") from None


@contextmanager
def kept_to_device(device: str | None) -> Iterator[None]:
    """Keep what the calling thread starts meanwhile on the device's cores, as
    `keep_to_device` keeps a worker (threads and processes inherit their starter's cores),
    then free the thread again: an engine started inside runs where its shard's worker would,
    in a process that drives engines on other cores too."""
    before = os.sched_getaffinity(0)
    keep_to_device(device)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def yield_to_helpers(nice: int) -> None:
    """Lower the CPU priority of this worker and of every thread and process it starts from
    now on (vLLM's among them) to `nice`, so that the database and the broker, which need
    little CPU but need it at once, do not queue behind an engine that busy-waits between
    steps. Where the kernel schedules each session as one group (autogroups), priorities weigh
    only within a session, so a worker that leads its own session (as `jobsvc`'s launcher
    starts workers) lowers that session too; a worker started from a terminal leaves the
    terminal's session alone."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError as error:
        log.warning("could not lower the worker's CPU priority to nice %d: %s", nice, error)
    if os.getsid(0) != os.getpid() or not autogroups_enabled():
        return
    try:
        _OWN_AUTOGROUP.write_text(str(nice))
    except OSError as error:
        log.warning("could not lower the worker's session to nice %d: %s", nice, error)


def autogroups_enabled() -> bool:
    """Whether the kernel schedules each session as one group."""
    try:
        return _AUTOGROUPS_SWITCH.read_text().strip() == "1"
    except OSError:
        return False


def held_elsewhere(seen: SeenWorker, host: str, pid: int,
                   running: Callable[[int], bool]) -> bool:
    """Whether the worker whose heartbeat this is holds the shard: it is alive and is not an
    earlier, ended process of this host (a crashed worker restarted at once, or a container
    restarted with the same name and process ID)."""
    if not seen.alive:
        return False
    other = seen.heartbeat
    return other.host != host or (other.pid != pid and running(other.pid))


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refuse_held_shard(settings: Settings, shard: int) -> None:
    """Shard numbers are unique across the fleet: refuse to start under one that a live worker
    on any host holds."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    try:
        seen = read_heartbeat(client, shard)
    finally:
        client.close()
    if seen is not None and held_elsewhere(seen, settings.resolved_worker_host, os.getpid(),
                                           _process_running):
        other = seen.heartbeat
        raise ConfigurationError(
            f"shard {shard} is held by worker {other.worker} (host {other.host}, pid "
            f"{other.pid}), last heard from {seen.age_s:.0f} s ago; start this worker under an "
            "unused shard number, or stop that one first")


def refuse_other_models(settings: Settings, shard: int) -> None:
    """A shard serves one model (and its adapters) for as long as it has jobs: refuse to start
    under a shard that holds unfinished jobs of a model this worker does not serve, which it
    would never run (they wait there for their own model's worker)."""
    served = {settings.served_model_name, *settings.lora_modules}
    store = Store(settings.resolved_database_url)
    try:
        with translated(f"read shard {shard}'s unfinished jobs"):
            others = {model: sum(counts.values())
                      for model, counts in store.active_by_model(shard).items()
                      if model not in served}
    finally:
        store.dispose()
    if others:
        held = ", ".join(f"{count} of model {model!r}" for model, count in sorted(others.items()))
        raise ConfigurationError(
            f"shard {shard} holds unfinished jobs ({held}) that this worker, serving "
            f"{sorted(served)}, would never run; start it under another shard number, or start "
            "a worker for that model under this one")


def stop_with_parent(parent: int) -> None:
    """Shut down warm (SIGTERM) when process `parent`, which started this worker, dies: a
    demo, a benchmark or a test killed outright leaves no worker behind."""
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent:
        raise SystemExit(f"the process that started this worker ({parent}) has ended")


def run_worker(settings: Settings, shard: int, device: str | None,
               parent: int | None = None) -> None:
    """Run the worker of `shard` until it stops (or `parent` dies), with its device bound
    before vLLM is imported; exits with Celery's code, so a supervisor restarts a worker that
    failed."""
    if parent is not None:
        stop_with_parent(parent)
    bind_device(settings, device)
    keep_to_device(device)
    yield_to_helpers(settings.worker_nice)
    from jobsvc.workers.celery_app import create_worker_app, worker_name

    refuse_held_shard(settings, shard)
    refuse_other_models(settings, shard)
    app = create_worker_app(settings, shard)
    from celery.bin.celery import celery as celery_command

    # What `app.start` does, keeping the worker's exit code (1 after an unrecoverable error)
    # that it drops when run from code: a supervisor restarts a worker that failed.
    next(option for option in celery_command.params if option.name == "app").default = app
    exit_code = celery_command.main(args=[
        "worker", "--queues", queue_name(shard), "--pool", "threads",
        "--concurrency", str(settings.worker_concurrency),
        "--hostname", worker_name(shard, settings.resolved_worker_host),
        "--loglevel", settings.log_level, "--without-mingle", "--without-gossip",
        "--heartbeat-interval", str(CELERY_HEARTBEAT_SECONDS),
    ], standalone_mode=False)
    raise SystemExit(exit_code or 0)
