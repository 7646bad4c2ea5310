"""The worker's Celery app: the shared transport configuration plus what only a worker needs
(late acknowledgement, one batch prefetched per thread, the run_batch task) and the signals
that start and stop the resident engine with the worker."""

from __future__ import annotations

import gc
import logging
import os
import socket
from typing import Any

import redis
from celery import Celery, signals
from celery.worker.control import control_command

from jobsvc.affinity import ShardState
from jobsvc.client import CANCEL_CHANNEL
from jobsvc.routing import queue_name
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.transport import RUN_BATCH_TASK, make_celery
from workers.batch import BatchRunner
from workers.engine import EngineAdapter, engine_args
from workers.gcpause import GcPauseMeter
from workers.recorder import ResultRecorder

log = logging.getLogger(__name__)


def worker_name(shard: int) -> str:
    return f"shard{shard}@{socket.gethostname()}"


class WorkerRuntime:
    """Everything a worker holds for its lifetime: engine, store, recorder, cancel listener."""

    def __init__(self, settings: Settings, shard: int) -> None:
        self.settings = settings
        self.shard = shard
        self.runner: BatchRunner | None = None
        self.gc_pauses = GcPauseMeter()
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=None)
        self._store = Store(settings.resolved_database_url)
        self.engine = EngineAdapter(engine_args(settings))
        self._recorder = ResultRecorder(self._store, ShardState(self._redis, settings.shards))
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        self._listener: Any = None

    def start(self) -> None:
        self.engine.start()
        self._recorder.start()
        self.runner = BatchRunner(shard=self.shard, worker_name=worker_name(self.shard),
                                  store=self._store, engine=self.engine,
                                  recorder=self._recorder)
        self._pubsub.subscribe(**{CANCEL_CHANNEL: self._on_cancel})
        self._listener = self._pubsub.run_in_thread(sleep_time=1.0, daemon=True)

    def _on_cancel(self, message: dict[str, Any]) -> None:
        if self.runner is not None:
            self.runner.abort_if_running(message["data"].decode())

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        self._recorder.stop()
        self.engine.shutdown()
        self._store.dispose()


def create_worker_app(settings: Settings, shard: int) -> Celery:
    app = make_celery(settings)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        worker_pool="threads",
        task_queues=None,
        worker_send_task_events=True,
    )
    runtime = WorkerRuntime(settings, shard)

    @app.task(name=RUN_BATCH_TASK, ignore_result=True)
    def run_batch(payload: Any) -> dict[str, int]:
        if runtime.runner is None:
            raise RuntimeError("run_batch before the worker started its engine")
        return runtime.runner.run(payload)

    def on_init(**_: Any) -> None:
        log.info("shard %d: starting the engine on queue %s", shard, queue_name(shard))
        try:
            runtime.start()
        except Exception:
            # Celery logs and ignores errors in signal handlers; a worker without its engine
            # must not consume (it would fail every batch), so leave at once instead.
            log.exception("shard %d: start-up failed; exiting", shard)
            os._exit(3)

    def on_ready(**_: Any) -> None:
        # Start-up objects (engine, model config, imports) will never be garbage: keep the
        # collector from scanning them again during every generation-2 pass.
        gc.freeze()
        runtime.gc_pauses.install()
        log.info("shard %d ready; %d objects frozen", shard, gc.get_freeze_count())

    def on_shutdown(**_: Any) -> None:
        runtime.stop()

    # Remote-control commands for benchmarks: `app.control.broadcast(name, reply=True)`.
    @control_command()
    def reset_prefix_cache(_state: Any) -> dict[str, bool]:
        runtime.engine.reset_prefix_cache()
        return {"ok": True}

    @control_command()
    def take_gc_pauses(_state: Any) -> dict[str, float]:
        return runtime.gc_pauses.take()

    signals.worker_init.connect(on_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
    return app
