"""The worker's Celery app: the shared transport configuration plus what only a worker needs
(late acknowledgement, one message prefetched per thread, the run_message task) and the signals
that start and stop the resident engine with the worker."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery, signals
from sqlalchemy.exc import SQLAlchemyError

from jobsvc.departures import ShardMover, rejoin
from jobsvc.keys import CANCEL_CHANNEL, queue_name
from jobsvc.prompts import PromptBuilder
from jobsvc.reconcile import Reconciler
from jobsvc.routing.feedback import CacheFeedback
from jobsvc.routing.ledger import LoadLedger
from jobsvc.served_models import served_by
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.transport import RUN_MESSAGE_TASK, make_celery, message_finished
from jobsvc.wire import MessageError, QueueMessage
from jobsvc.workers import broker_fixes
from jobsvc.workers.collector import CollectionWindow
from jobsvc.workers.drain import DrainWatch
from jobsvc.workers.engine import EngineAdapter, Pacing, engine_args
from jobsvc.workers.engine_reaper import EngineReaper
from jobsvc.workers.heartbeat import BatchActivity, HeartbeatKeeper
from jobsvc.workers.hooks import HookChain, WorkerContext, WorkerHooks, load_hooks
from jobsvc.workers.leases import LeaseKeeper
from jobsvc.workers.message_runner import MessageRunner
from jobsvc.workers.metrics import WorkerMetrics, serve_metrics
from jobsvc.workers.recorder import ResultRecorder

log = logging.getLogger(__name__)


def worker_name(shard: int, host: str) -> str:
    """The Celery name of `shard`'s worker on `host`, as Flower and the heartbeat show it."""
    return f"shard{shard}@{host}"


EXIT_ENGINE_DEAD = 70
# How often a worker asks the store whether any job it runs was cancelled.
_CANCEL_CHECK_SECONDS = 3.0


class WorkerRuntime:
    """Everything a worker holds for its lifetime: engine, store, recorder, leases, the
    cancel listener, the reconciler that sends stranded jobs again, and its heartbeat."""

    def __init__(self, settings: Settings, shard: int, hooks: WorkerHooks) -> None:
        self.settings = settings
        self.shard = shard
        self.hooks = hooks
        self.runner: MessageRunner | None = None
        self.collections = CollectionWindow()
        self._redis = redis.Redis.from_url(settings.redis_url, socket_timeout=None)
        broker_fixes.install(self._redis, queue_name(shard))
        self._store = Store(settings.resolved_database_url)
        self.engine = EngineAdapter(engine_args(settings), Pacing.from_settings(settings),
                                    on_engine_dead=self._engine_died,
                                    loras=settings.lora_modules)
        self._reaper = EngineReaper()
        self._feedback = CacheFeedback(self._redis)
        self._recorder = ResultRecorder(self._store, LoadLedger(self._redis),
                                        self._feedback, settings.block_size)
        self.leases = LeaseKeeper(self._redis, settings.visibility_timeout)
        self.prompts = PromptBuilder(settings.model, settings.max_model_len)
        self._control = make_celery(settings)
        self._reconciler = Reconciler(settings, self._redis, self._store, self._control,
                                      own_shard=shard)
        self.activity = BatchActivity()
        self.name = worker_name(shard, settings.resolved_worker_host)
        self._heartbeat = HeartbeatKeeper(settings.redis_url, shard, self.name, self.activity,
                                          served=served_by(settings, self.prompts.context_length))
        self._drain = DrainWatch(self._redis, shard, self.activity,
                                 ShardMover(settings, self._redis, self._store, self._control),
                                 stop_consuming=self._stop_consuming,
                                 shut_down=lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._stopped = threading.Event()
        self._background = [
            threading.Thread(target=self._drain.run, args=(self._stopped,), name="drain-watch",
                             daemon=True),
            threading.Thread(target=self._listen_for_cancels, name="cancel-listener",
                             daemon=True),
            threading.Thread(target=self._reconcile, name="reconciler", daemon=True),
            threading.Thread(target=self._watch_engine, name="engine-watch", daemon=True),
        ]

    def start(self) -> None:
        """Start everything in order, the engine first, and report the fresh engine before any
        message is taken."""
        self._heartbeat.start(metrics_port=serve_metrics(self.settings, self.shard))
        self._reaper.start()
        self.engine.start()
        self._reaper.engine_started()
        self._heartbeat.engine_started(served_by(self.settings, self.engine.context_length))
        # A fresh engine holds nothing: the router forgets its estimate for this shard, which
        # takes work again even if it had left the fleet or was being drained.
        self._feedback.engine_started(self.shard, self.engine.cache_blocks)
        rejoin(self._redis, self.shard)
        self._recorder.start()
        self.leases.start()
        self.runner = MessageRunner(shard=self.shard, worker_name=self.name,
                                  store=self._store, engine=self.engine,
                                  recorder=self._recorder, prompts=self.prompts,
                                  max_attempts=self.settings.max_attempts,
                                  batch_size=self.settings.batch_size, hooks=self.hooks,
                                  model=self.settings.served_model_name,
                                  adapters=list(self.settings.lora_modules))
        for thread in self._background:
            thread.start()

    @contextmanager
    def finishing(self, message_id: str, payload: Any) -> Iterator[None]:
        """Take a message out of the shard's message set once its task ends (the task is then
        acknowledged); a task that ends on an error hands its jobs to reconciliation, which
        sends again those it left unfinished. A worker killed meanwhile leaves the message in
        the set: its lease runs out and the message comes back."""
        try:
            yield
        except BaseException:
            try:
                dropped = QueueMessage.from_wire(payload, message_id).job_ids
            except MessageError:
                # Not ours: it names no job that could run.
                dropped = []
            self._forget_message(message_id, dropped)
            raise
        self._forget_message(message_id, [])

    def _forget_message(self, message_id: str, dropped: list[str]) -> None:
        try:
            message_finished(self._redis, self.shard, message_id, dropped)
        except redis.RedisError as error:
            # Left in the set, which then outnumbers the queue: reconciliation's check of
            # the sets against their queues takes it out, and sends its jobs again if it
            # left any unfinished.
            log.warning("shard %d: could not forget finished message %s: %s", self.shard,
                        message_id, error)

    def stop(self) -> None:
        """Stop everything: the heartbeat first (its last record says the worker stopped), the
        engine only once the recorder has written every result it was handed."""
        self._stopped.set()
        self._heartbeat.stop()
        self.hooks.on_stop()
        self.leases.stop()
        self._recorder.stop()
        self.engine.shutdown()
        self._reaper.stop()
        self._store.dispose()

    def _stop_consuming(self) -> None:
        """Take no more messages from the shard queue (asked through Celery's remote
        control, which the worker's own consumer carries out)."""
        self._control.control.cancel_consumer(queue_name(self.shard), destination=[self.name],
                                              reply=True, timeout=10)

    def _engine_died(self, error: BaseException) -> None:
        # Exit without acknowledging anything: the messages in flight return to the queue
        # when their leases run out, and a restarted worker runs them on a fresh engine.
        log.critical("shard %d: the engine died (%s); exiting so a restart can recover",
                     self.shard, error)
        os._exit(EXIT_ENGINE_DEAD)

    def _watch_engine(self) -> None:
        """Notice an engine that died while idle, not only when a request fails."""
        while not self._stopped.wait(1.0):
            if self.engine.dead:
                self._engine_died(RuntimeError("engine processes exited"))

    def _listen_for_cancels(self) -> None:
        """Abort cancelled jobs running here, told at once on the cancel channel; survives
        Redis restarts by resubscribing. A notice published while the subscription was down is
        lost, so every few seconds the store is asked too."""
        runner = self.runner
        assert runner is not None  # started by start(), once the runner is there
        checked = time.monotonic()
        while not self._stopped.is_set():
            try:
                with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(CANCEL_CHANNEL)
                    while not self._stopped.is_set():
                        message = pubsub.get_message(timeout=1.0)
                        if message is not None:
                            runner.abort_if_running(message["data"].decode(errors="replace"),
                                                    "cancel notice")
                        if time.monotonic() - checked >= _CANCEL_CHECK_SECONDS:
                            checked = time.monotonic()
                            self._abort_cancelled_in_store(runner)
            except redis.RedisError as error:
                log.warning("cancel listener lost Redis (%s); resubscribing", error)
                self._stopped.wait(1.0)

    def _abort_cancelled_in_store(self, runner: MessageRunner) -> None:
        running = runner.running_jobs()
        if not running:
            return
        try:
            cancelled = self._store.cancelled_among(running)
        except SQLAlchemyError as error:
            log.warning("could not check running jobs for cancels: %s", type(error).__name__)
            return
        for job_id in cancelled:
            runner.abort_if_running(job_id, "store check")

    def _reconcile(self) -> None:
        while not self._stopped.wait(self.settings.requeue_interval):
            try:
                self._reconciler.run_round()
            except Exception as error:
                log.warning("reconciler: %s: %s", type(error).__name__, error)


def create_worker_app(settings: Settings, shard: int) -> Celery:
    """The worker's Celery app for `shard`: late acknowledgement, one message prefetched per thread,
    and the signals that tie the engine's life to the worker's."""
    app = make_celery(settings)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        worker_pool="threads",
        task_queues=None,
        # No task events until a monitor asks for them: Flower turns them on
        # when it connects (and every 5 s, for workers started later). Unwatched, they cost
        # the consumer thread CPU for every job, on cores the engine needs.
        worker_send_task_events=False,
        # Messages keep running through a broker reconnect; their leases and idempotent
        # result writes make a later redelivery harmless.
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    hooks = load_hooks(settings.worker_hooks)
    if settings.metrics_port:
        hooks = HookChain([WorkerMetrics(shard), hooks])
    runtime = WorkerRuntime(settings, shard, hooks)

    @app.task(name=RUN_MESSAGE_TASK, ignore_result=True, bind=True)
    def run_message(task: Any, payload: Any) -> dict[str, int]:
        if runtime.runner is None:
            raise RuntimeError("run_message before the worker started its engine")
        request = task.request
        tag = (request.properties or {}).get("delivery_tag")
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        with runtime.collections.busy(), runtime.activity.running(), \
                runtime.finishing(request.id, payload):
            if tag is None:
                return runtime.runner.run(payload, request.id, redelivered)
            runtime.leases.hold(tag)
            try:
                return runtime.runner.run(payload, request.id, redelivered)
            finally:
                runtime.leases.release(tag)

    def on_init(**_: Any) -> None:
        log.info("shard %d: starting the engine on queue %s", shard, queue_name(shard))
        try:
            runtime.start()
        except Exception:
            # Celery logs and ignores errors in signal handlers; a worker without its engine
            # must not consume (it would fail every message), so leave at once instead.
            log.exception("shard %d: start-up failed; exiting", shard)
            os._exit(3)

    def on_ready(**_: Any) -> None:
        # Start-up objects (engine, model config, imports) will never be garbage: keep the
        # collector from scanning them again during every generation-2 pass.
        gc.collect()
        gc.freeze()
        runtime.hooks.on_start(WorkerContext(shard, runtime.engine, runtime.prompts,
                                             runtime.collections))
        log.info("shard %d ready; %d objects frozen", shard, gc.get_freeze_count())

    def on_shutdown(**_: Any) -> None:
        runtime.stop()

    signals.worker_init.connect(on_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
    return app
