"""Where instruments attach to a worker: a call when the worker is ready and when it stops, and
one at each step of a message's life (claimed, admitted to the engine, its jobs ended, finished).
A worker calls the no-op `WorkerHooks` unless `JOBSVC_WORKER_HOOKS` names a factory of other
hooks, imported at start-up; so the product carries no instrument, and a benchmark or a probe
attaches from a package of its own. The worker's own metrics attach the same way, chained
before those."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from jobsvc.errors import ConfigurationError
from jobsvc.prompts import PromptBuilder
from jobsvc.store import ClaimedJob
from jobsvc.workers.collector import CollectionWindow
from jobsvc.workers.engine import EngineAdapter, EngineResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """What a ready worker lends its hooks: its shard, its started engine, the prompt builder
    its messages use, and the window that holds collections off while work runs (work a hook
    drives on the engine belongs inside it, as a message does)."""

    shard: int
    engine: EngineAdapter
    prompts: PromptBuilder
    collections: CollectionWindow


@dataclass(frozen=True)
class FinishedMessage:
    """A message whose results are all committed: the jobs it ran, as claimed, and how each
    ended in the engine (in the order they ended)."""

    shard: int
    admitted_at: float
    jobs: Sequence[ClaimedJob]
    results: Sequence[EngineResult]


class WorkerHooks:
    """Does nothing at every point; instruments override the points they need. The message
    points run on the message's own thread, in its hot path: an override must be quick and must
    not raise."""

    def on_start(self, worker: WorkerContext) -> None:
        """The engine runs and start-up objects are frozen; the worker consumes next."""

    def on_claim(self, job_ids: Sequence[str]) -> None:
        """Claimed jobs that this worker admits to the engine together next: a message's,
        or one suspect that runs alone (called only when there are any)."""

    def on_admit(self, jobs: int, admitted_at: float) -> None:
        """A message of `jobs` requests goes to the engine at `admitted_at` (`time.time()`)."""

    def on_message_end(self, jobs: int, admitted_at: float) -> None:
        """Every result of the message admitted at `admitted_at` is committed; its message is
        acknowledged next."""

    def on_jobs_finished(self, message: FinishedMessage) -> None:
        """The message's jobs ended and their results are committed (called before
        `on_message_end`, for messages that ran any job)."""

    def on_stop(self) -> None:
        """The worker shuts down."""


class HookChain(WorkerHooks):
    """Several hooks, each called in turn at every point."""

    def __init__(self, hooks: Sequence[WorkerHooks]) -> None:
        self._hooks = tuple(hooks)

    def on_start(self, worker: WorkerContext) -> None:
        """Call every hook's `on_start`."""
        for hooks in self._hooks:
            hooks.on_start(worker)

    def on_claim(self, job_ids: Sequence[str]) -> None:
        """Call every hook's `on_claim`."""
        for hooks in self._hooks:
            hooks.on_claim(job_ids)

    def on_admit(self, jobs: int, admitted_at: float) -> None:
        """Call every hook's `on_admit`."""
        for hooks in self._hooks:
            hooks.on_admit(jobs, admitted_at)

    def on_jobs_finished(self, message: FinishedMessage) -> None:
        """Call every hook's `on_jobs_finished`."""
        for hooks in self._hooks:
            hooks.on_jobs_finished(message)

    def on_message_end(self, jobs: int, admitted_at: float) -> None:
        """Call every hook's `on_message_end`."""
        for hooks in self._hooks:
            hooks.on_message_end(jobs, admitted_at)

    def on_stop(self) -> None:
        """Call every hook's `on_stop`."""
        for hooks in self._hooks:
            hooks.on_stop()


def load_hooks(path: str) -> WorkerHooks:
    """The hooks a `module:factory` path names (the factory is called with no argument), or
    the no-op ones for an empty path."""
    if not path:
        return WorkerHooks()
    module_name, _, factory_name = path.partition(":")
    if not module_name or not factory_name:
        raise ConfigurationError(f"JOBSVC_WORKER_HOOKS={path!r} is not of the form "
                                 "module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigurationError(f"JOBSVC_WORKER_HOOKS={path!r}: cannot import "
                                 f"{module_name} ({error})") from error
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigurationError(f"JOBSVC_WORKER_HOOKS={path!r}: {module_name} has no "
                                 f"callable {factory_name}")
    hooks = factory()
    if not isinstance(hooks, WorkerHooks):
        raise ConfigurationError(f"JOBSVC_WORKER_HOOKS={path!r} made a "
                                 f"{type(hooks).__name__}, not WorkerHooks")
    log.info("worker hooks attached from %s", path)
    return hooks
