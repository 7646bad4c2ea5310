"""What the server's routes and its batch driver share, made once when the server starts
(and by `jobsvc run-batch`, which drives its one batch itself)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from fastapi import Request
from prometheus_client import CollectorRegistry

from jobsvc.batchapi.driver import BatchDriver
from jobsvc.batchapi.ingest import Ingestor
from jobsvc.client import Client
from jobsvc.fleet import FleetReader
from jobsvc.metrics import fleet_registry
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.batches import BatchStore
from jobsvc.store.files import FileStore
from jobsvc.webhooks import WebhookSender


@dataclass
class Services:
    """Everything the routes and the batch driver share, opened once per server and closed with it,
    so no request opens a pool of its own."""

    settings: Settings
    client: Client
    # The database of the files, the batches and the fleet's metrics.
    store: Store
    files: FileStore
    batches: BatchStore
    ingestor: Ingestor
    # The fleet's metrics (every shard's queue, unfinished jobs and load; batches by status),
    # read at each scrape of /metrics.
    metrics: CollectorRegistry
    # The Redis client of those metrics.
    fleet_redis: redis.Redis
    driver: BatchDriver | None = None
    # Sends the webhooks of ended batches, where endpoints are configured.
    webhooks: WebhookSender | None = None
    # When this server started: the `created` time of the model it serves.
    started: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def open(cls, settings: Settings) -> Services:
        """The services of a server run with `settings`; the driver is started apart."""
        client = Client(settings=settings)
        store = Store(settings.resolved_database_url)
        ingestor = Ingestor(client, limits=settings.job_limits)
        fleet_redis = redis.Redis.from_url(settings.redis_url)
        fleet = FleetReader(settings, fleet_redis, store)
        return cls(settings, client, store, FileStore(store.engine), BatchStore(store.engine),
                   ingestor, fleet_registry(fleet.read), fleet_redis)

    def new_driver(self, only: str | None = None) -> BatchDriver:
        """A batch driver on these services: of every batch, or of batch `only`."""
        return BatchDriver(self.settings, self.client, self.ingestor, self.store.engine,
                           only=only)

    def start_driver(self) -> None:
        """Start the driver of every batch, for the server's life."""
        self.driver = self.new_driver()
        self.driver.start()

    def start_webhooks(self) -> None:
        """Start sending webhooks for the server's life, if any endpoint is configured."""
        if self.settings.webhook_endpoints:
            self.webhooks = WebhookSender(self.settings, self.store)
            self.webhooks.start()

    def wake_driver(self) -> None:
        """Have the driver take a round now, so a new or cancelled batch moves without waiting."""
        if self.driver is not None:
            self.driver.wake()

    def close(self) -> None:
        """Stop the driver (handing its batches back) and the webhooks' sender, then close
        the connections."""
        if self.driver is not None:
            self.driver.stop()
        if self.webhooks is not None:
            self.webhooks.stop()
        self.client.close()
        self.fleet_redis.close()
        self.store.dispose()


def services_of(request: Request) -> Services:
    """The services of the app serving `request`."""
    return request.app.state.services  # type: ignore[no-any-return]
