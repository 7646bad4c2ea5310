"""Remote control of the test worker (the commands the bench's probes add to it)."""

from __future__ import annotations

from typing import Any

from jobsvc.settings import Settings
from jobsvc.transport import make_celery


def ask_worker(settings: Settings, command: str, arguments: dict[str, Any],
               timeout: float = 30) -> dict[str, Any]:
    """The test worker's reply to a remote-control command."""
    replies = make_celery(settings).control.broadcast(command, arguments=arguments, reply=True,
                                                      timeout=timeout, limit=1)
    assert len(replies) == 1, replies
    (reading,) = replies[0].values()
    return reading


def set_pacing(settings: Settings, chunk: int, pause_ms: float) -> dict[str, Any]:
    """Pace the test worker's later batches; returns its reply (the pacing it replaced)."""
    return ask_worker(settings, "set_admission_pacing", {"chunk": chunk, "pause_ms": pause_ms})
