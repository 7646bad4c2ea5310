"""The one door a job goes through to a shard queue, whoever sends it: a producer's new jobs
(`Client`), the jobs of a shard that left the fleet (`departures.ShardMover`), jobs whose
message Redis lost (`reconcile.Reconciler`, through `resend`).

Every job takes the same steps, each done here once:
  route     the router picks a live shard and charges the load ledger
  form      `messages.form_messages` cuts the jobs into per-shard messages
  record    the store takes the jobs' shards and messages, before anything is published: a
            worker runs a job only from the message its row names
  publish   `transport.publish` sends the messages in one pipeline
and what routing charged for a job that was not kept (the store refused it, a concurrent
submit holds its idempotency key, Redis refused the publish, a moved job stays where it is) is
given back to the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from celery import Celery

from jobsvc.embeddings import is_embedding
from jobsvc.errors import (
    BROKER_ERRORS,
    STORAGE_ERRORS,
    BrokerUnavailable,
    StorageUnavailable,
    translated,
)
from jobsvc.messages import PlacedJob, form_messages
from jobsvc.routing.job_cost import (
    Route,
    RoutingJob,
    answer_tokens,
    decode_load,
    loads_per_shard,
)
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.live import NoLiveShard
from jobsvc.routing.prefix import DocumentKeys, adapted, document_keys, unrouted
from jobsvc.routing.router import Router, make_router
from jobsvc.served_models import FleetModels
from jobsvc.settings import Settings
from jobsvc.store import MovableJob, NewDocument, NewJob, SentJob, Store
from jobsvc.transport import publish
from jobsvc.wire import QueueMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedJob:
    """A job ready to record: its prompt as a shared prefix (a document, or the part of a
    rendered request that other requests share), stored once however many jobs run on it,
    and the job's own suffix, both already tokenized; the engine runs prefix + suffix.
    `question` is kept in the job's record as what it asked (the suffix's text for requests
    of a batch file). `idempotency_key`: see `Client.submit_many`. An embedding job's prefix is
    its inputs' tokens, its suffix empty (`jobsvc.embeddings`)."""

    prefix: str
    prefix_tokens: Sequence[int]
    question: str
    suffix_tokens: Sequence[int]
    sampling: dict[str, Any]
    idempotency_key: str | None = None
    # The served model or LoRA adapter that runs it (`jobsvc.served_models`).
    model: str = field(kw_only=True)

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt's length, what the engine must fit in its context."""
        return len(self.prefix_tokens) + len(self.suffix_tokens)


@dataclass(frozen=True)
class _Routed:
    """Jobs with their shards, and what routing charged each one."""

    placed: list[PlacedJob]
    routes: list[Route]

    def charges(self, job_ids: set[str] | None = None) -> dict[int, int]:
        """What these jobs (or those of them named) charged each shard."""
        return loads_per_shard((route.shard, route.load) for job, route in zip(
            self.placed, self.routes, strict=True) if job_ids is None or job.job_id in job_ids)


class Dispatcher:
    """Routes, records and publishes jobs, and keeps the load ledger true to what it kept:
    the only code that sends a job to a shard queue."""

    def __init__(self, settings: Settings, client: redis.Redis, store: Store, celery: Celery,
                 ledger: LoadLedger) -> None:
        self._settings = settings
        self._redis = client
        self._store = store
        self._celery = celery
        self._ledger = ledger
        self._router = make_router(client, ledger, settings)
        self._models = FleetModels(client, settings)

    def submit(self, jobs: Sequence[PreparedJob], job_ids: Sequence[str]) -> dict[str, str]:
        """Route, record and publish new jobs under these IDs. Returns, for jobs whose
        idempotency key a concurrent submit recorded first, the ID of that submit's job: they
        are neither recorded nor published. Raises StorageUnavailable or BrokerUnavailable,
        having kept nothing, if the database or Redis refuses."""
        # jobs --> routes: each distinct prefix hashed once (jobs on one prefix share its
        # token list).
        keys: dict[int, DocumentKeys] = {}
        for job in jobs:
            if id(job.prefix_tokens) not in keys:
                keys[id(job.prefix_tokens)] = document_keys(job.prefix_tokens,
                                                            self._settings.block_size)
        prefix_keys = [keys[id(job.prefix_tokens)] for job in jobs]
        cost = self._settings.routing_decode_cost
        with translated(f"route {len(jobs)} jobs; nothing was recorded or enqueued"):
            adapters = self._adapters()
            routed = self._route(self._router, job_ids, [
                RoutingJob(_routing_keys(prefix, job.model, is_embedding(job.sampling), adapters),
                           job.prompt_tokens, decode_load(answer_tokens(job.sampling), cost))
                for job, prefix in zip(jobs, prefix_keys, strict=True)],
                [prefix.document_key for prefix in prefix_keys], [job.model for job in jobs])
        # routes --> messages
        messages = form_messages(routed.placed, self._settings.batch_size)
        # messages --> store
        documents, new_jobs = _submitted(jobs, prefix_keys, routed, messages)
        try:
            taken = self._store.record_submitted(documents, new_jobs)
        except STORAGE_ERRORS as error:
            self._give_back(routed.charges())
            raise StorageUnavailable(
                f"could not record {len(jobs)} jobs ({type(error).__name__}); nothing was "
                "enqueued, submit them again once the database is back") from error
        if taken:
            self._give_back(routed.charges(set(taken)))
            messages = [replace(message, job_ids=kept) for message in messages
                        if (kept := [job_id for job_id in message.job_ids
                                     if job_id not in taken])]
        # messages --> shard queues
        try:
            publish(self._celery, self._redis, messages)
        except Exception as error:
            recorded = [job_id for job_id in job_ids if job_id not in taken]
            with translated(f"withdraw {len(recorded)} jobs after Redis refused them"):
                self._store.forget_submitted(recorded)
            self._give_back(routed.charges(set(recorded)))
            raise BrokerUnavailable(
                f"could not enqueue {len(recorded)} jobs ({type(error).__name__}: {error}); "
                "nothing was kept, submit them again") from error
        log.debug("submitted %d jobs", len(jobs) - len(taken))
        return taken

    def move(self, shard: int, jobs: Sequence[MovableJob], *,
             unclaimed_only: bool) -> dict[str, int]:
        """Route jobs of `shard`, which left the fleet, again to live shards, record their new
        shards, messages and loads (only where each is still unfinished there, and unclaimed
        if asked), then publish. Returns the new shard of each job moved."""
        # A router of its own reads the live set afresh: the shard has just left it.
        router = make_router(self._redis, self._ledger, self._settings)
        # A job whose model no live worker serves stays, waiting for one.
        live = _live_models(router, {job.model for job in jobs})
        jobs = [job for job in jobs if job.model in live]
        if not jobs:
            return {}
        cost = self._settings.routing_decode_cost
        adapters = self._adapters()
        # Jobs on one document share its keys: each document is hashed once.
        keys = {job.document_key: _stored_keys(job, self._settings.block_size)
                for job in jobs}
        routed = self._route(router, [job.job_id for job in jobs], [
            RoutingJob(_routing_keys(keys[job.document_key], job.model, job.by_load, adapters),
                       job.prompt_tokens, decode_load(job.answer_tokens, cost))
            for job in jobs], [job.document_key for job in jobs], [job.model for job in jobs])
        messages = form_messages([placed for placed in routed.placed if placed.shard != shard],
                                 self._settings.batch_size)
        route_of = {placed.job_id: route for placed, route
                    in zip(routed.placed, routed.routes, strict=True) if placed.shard != shard}
        moved = self._store.move_jobs(shard, messages, route_of, unclaimed_only=unclaimed_only)
        # What routing charged for jobs that stay, and what the moved ones held on the shard
        # they left, is given back.
        self._give_back(loads_per_shard(
            [*routed.charges({job.job_id for job in jobs if job.job_id not in moved}).items(),
             *((shard, job.load) for job in jobs if job.job_id in moved)]))
        # Recorded first: should the send fail, the jobs have no live message and the
        # reconciler sends them again on their new shards.
        publish(self._celery, self._redis, [message for message in messages
                               if any(job_id in moved for job_id in message.job_ids)])
        return {job_id: route_of[job_id].shard for job_id in moved}

    def resend(self, lost: Sequence[SentJob]) -> int:
        """Send again unfinished jobs whose message Redis no longer holds, on the shards they
        are recorded on (their load stays charged there). A job no worker has claimed goes in
        a message under the very ID its record names, which costs the store nothing: a copy
        of that message somewhere else finds it claimed, or runs it first. A claimed one is
        taken from its worker by a new message. Returns how many were sent."""
        unclaimed: dict[tuple[int, str], list[str]] = {}
        claimed: dict[int, list[str]] = {}
        for job in lost:
            if job.claimed or job.message_id is None:
                claimed.setdefault(job.shard, []).append(job.job_id)
            else:
                unclaimed.setdefault((job.shard, job.message_id), []).append(job.job_id)
        publish(self._celery, self._redis, [QueueMessage(shard, job_ids, message_id)
                               for (shard, message_id), job_ids in unclaimed.items()])
        return len(lost) - sum(map(len, claimed.values())) + self._requeue(claimed)

    def _requeue(self, stranded: Mapping[int, Sequence[str]]) -> int:
        """Send unfinished jobs again, on the shards they are recorded on, in new messages
        (their load stays charged there). Returns how many were sent."""
        # The jobs' documents are recorded: a message's jobs only need to stand together.
        messages = form_messages([PlacedJob(job_id, shard, "") for shard, job_ids
                                  in stranded.items() for job_id in job_ids],
                                 self._settings.batch_size)
        if not messages:
            return 0
        # Recorded first: should the send fail, the next round finds the jobs again.
        self._store.assign_messages(messages)
        publish(self._celery, self._redis, messages)
        return sum(len(message.job_ids) for message in messages)

    @staticmethod
    def _route(router: Router, job_ids: Sequence[str], jobs: Sequence[RoutingJob],
               documents: Sequence[str], models: Sequence[str]) -> _Routed:
        """Pick the jobs' shards among their models', charging them; `documents`: each job's
        document key, `models`: each job's model."""
        route_at: dict[int, Route] = {}
        for model in dict.fromkeys(models):
            positions = [index for index, name in enumerate(models) if name == model]
            route_at.update(zip(positions, router.route([jobs[i] for i in positions], model),
                                strict=True))
        routes = [route_at[index] for index in range(len(jobs))]
        return _Routed([PlacedJob(job_id, route.shard, key) for job_id, route, key
                        in zip(job_ids, routes, documents, strict=True)], routes)

    def _adapters(self) -> set[str]:
        """The names of the fleet's LoRA adapters, read once per submit or move."""
        return {name for name, model in self._models.models().items() if model.base}

    def _give_back(self, charges: dict[int, int]) -> None:
        """Give back what routing charged for jobs that were not kept; if Redis is gone too,
        the reconciler returns it later."""
        try:
            self._ledger.release(charges)
        except BROKER_ERRORS as error:
            log.warning("could not give back the load of jobs not kept %s: %s", charges, error)

    def live_models(self, models: Iterable[str]) -> set[str]:
        """Those of `models` that a live worker, not draining, serves now (read afresh)."""
        return _live_models(make_router(self._redis, self._ledger, self._settings), models)


def _live_models(router: Router, models: Iterable[str]) -> set[str]:
    live: set[str] = set()
    for model in models:
        try:
            if router.model_shards(model).live:
                live.add(model)
        except NoLiveShard:
            continue
    return live


def _routing_keys(keys: DocumentKeys, model: str, by_load: bool,
                  adapters: set[str]) -> DocumentKeys:
    """What routes a job: its prompt's blocks, taken again under its adapter's name if it
    names one of the LoRA `adapters`; nothing but its load for a job routed by load."""
    if by_load:
        return unrouted(keys.document_key)
    return adapted(keys, model) if model in adapters else keys


def _stored_keys(job: MovableJob, block_size: int) -> DocumentKeys:
    """The job's document keys as its producer made them; a document kept only as text (or
    not readable) is routed by its key alone, which costs at most a cache miss."""
    if isinstance(job.document, tuple):
        return document_keys(job.document, block_size)
    return unrouted(job.document_key)


def _submitted(jobs: Sequence[PreparedJob], prefix_keys: Sequence[DocumentKeys],
               routed: _Routed, messages: Sequence[QueueMessage]
               ) -> tuple[list[NewDocument], list[NewJob]]:
    """New jobs and their prefixes (each prefix once) as the store records them: workers
    read everything a job runs from there, since queue messages only name jobs."""
    message_of = {job_id: message.message_id for message in messages
                  for job_id in message.job_ids}
    prefixes = {prefix.document_key: job for job, prefix in zip(jobs, prefix_keys, strict=True)}
    documents = [NewDocument(key, job.prefix, job.prefix_tokens)
                 for key, job in prefixes.items()]
    new_jobs = [NewJob(
        job_id=placed.job_id, document_key=placed.document_key, question=job.question,
        question_tokens=job.suffix_tokens, sampling=job.sampling, model=job.model,
        shard=placed.shard,
        prompt_tokens=job.prompt_tokens, estimated_prefill=route.estimated_prefill,
        load=route.load, message_id=message_of[placed.job_id],
        idempotency_key=job.idempotency_key,
    ) for job, placed, route in zip(jobs, routed.placed, routed.routes, strict=True)]
    return documents, new_jobs
