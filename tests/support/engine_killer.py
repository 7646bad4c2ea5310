"""Worker hooks for the fault tests: a job that kills its engine. A job whose ID starts with
KILLER_PREFIX kills the engine's core process as it is admitted, every time, whatever else
runs beside it, as a request that crashes vLLM would."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import psutil

from jobsvc.workers.hooks import WorkerHooks

KILLER_PREFIX = "dead"


class EngineKiller(WorkerHooks):
    def on_claim(self, job_ids: Sequence[str]) -> None:
        if any(job_id.startswith(KILLER_PREFIX) for job_id in job_ids):
            for child in psutil.Process().children(recursive=True):
                if "EngineCore" in child.name():
                    os.kill(child.pid, signal.SIGKILL)
