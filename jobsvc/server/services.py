"""What the server's routes and its batch driver share, made once when the server starts
(and by `jobsvc run-batch`, which drives its one batch itself)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from fastapi import Request
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from jobsvc.batchapi.batchstore import BatchStore
from jobsvc.batchapi.driver import BatchDriver
from jobsvc.batchapi.filestore import FileStore
from jobsvc.batchapi.ingest import Ingestor
from jobsvc.batchapi.rendering import ChatTemplate
from jobsvc.client import Client
from jobsvc.fleet import FleetReader
from jobsvc.metrics import fleet_registry
from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings
from jobsvc.store import Store, make_engine


@dataclass
class Services:
    settings: Settings
    client: Client
    engine: Engine
    files: FileStore
    batches: BatchStore
    ingestor: Ingestor
    # The fleet's metrics (every shard's queue, unfinished jobs and load; batches by status),
    # read at each scrape of /metrics.
    metrics: CollectorRegistry
    driver: BatchDriver | None = None
    # When this server started: the `created` time of the model it serves.
    started: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def open(cls, settings: Settings) -> Services:
        client = Client(settings=settings)
        engine = make_engine(settings.resolved_database_url)
        ingestor = Ingestor(client, PromptBuilder(settings.model, settings.max_model_len),
                            ChatTemplate(settings.model),
                            served_model=settings.served_model_name,
                            max_stop_chars=settings.max_stop_chars)
        fleet = FleetReader(settings, redis.Redis.from_url(settings.redis_url),
                            Store(settings.resolved_database_url))
        return cls(settings, client, engine, FileStore(engine), BatchStore(engine), ingestor,
                   fleet_registry(fleet.read))

    def new_driver(self, only: str | None = None) -> BatchDriver:
        return BatchDriver(self.settings, self.client, self.ingestor, self.engine, only=only)

    def start_driver(self) -> None:
        self.driver = self.new_driver()
        self.driver.start()

    def wake_driver(self) -> None:
        if self.driver is not None:
            self.driver.wake()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.stop()
        self.client.close()
        self.engine.dispose()


def services_of(request: Request) -> Services:
    """The services of the app serving `request`."""
    return request.app.state.services  # type: ignore[no-any-return]
