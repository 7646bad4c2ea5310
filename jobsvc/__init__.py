"""jobsvc: queue-driven document-question inference jobs on vLLM, routed by prefix hash."""

from jobsvc.async_client import AsyncClient
from jobsvc.client import Client
from jobsvc.errors import BrokerUnavailable, InvalidJob, JobNotFound, StorageUnavailable
from jobsvc.store import JobRecord
from jobsvc.wire import JobStatus

__all__ = ["AsyncClient", "BrokerUnavailable", "Client", "InvalidJob", "JobNotFound", "JobRecord",
           "JobStatus", "StorageUnavailable"]
