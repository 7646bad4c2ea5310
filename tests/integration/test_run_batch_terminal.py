"""`jobsvc run-batch` in a real terminal (tmux) on the test worker: its progress bar ticks
every second and moves request by request, not only when the whole file is done."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import psutil
import pytest

from jobsvc.child_processes import LocalWorkers, settings_environment
from jobsvc.settings import Settings
from jobsvc.workloads import document, question
from tests.support.terminal import Pane, bars, until_shown, watch
from tests.support.waiting import until

pytestmark = pytest.mark.integration


def test_the_run_batch_bar_ticks_and_moves_with_the_requests(
        settings: Settings, worker: LocalWorkers, tmp_path: Path) -> None:
    rng = random.Random(54)
    documents = [document(rng, 300) for _ in range(48)]
    # More messages than the worker runs at once: requests finish message after message.
    requests = [{"custom_id": f"d{d}-q{q}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": settings.served_model_name, "max_tokens": 16,
                          "prompt": f"{text}\n\nQuestion: {question(rng)}", "ignore_eos": True}}
                for q in range(4) for d, text in enumerate(documents)]
    batch_file = tmp_path / "requests.jsonl"
    batch_file.write_text("".join(json.dumps(request) + "\n" for request in requests))
    environment = {**settings_environment(settings), "PATH": os.environ["PATH"],
                   "HOME": str(tmp_path), "TERM": "xterm"}
    pane = Pane([sys.executable, "-m", "jobsvc", "run-batch", "-i", str(batch_file), "-o",
                 str(tmp_path / "out.jsonl")], tmp_path, environment)
    try:
        until_shown(pane, "the requests' progress bar",
                    lambda: any(total == len(requests) for _, total, _ in bars(pane)))
        seen = watch(pane, 3)
        assert len({elapsed for _, _, elapsed in seen}) >= 2, seen
        until_shown(pane, "a count between none and all", lambda: any(
            0 < done < total for done, total, _ in bars(pane)))
        until("run-batch's end", lambda: not pane.process.is_running()
              or pane.process.status() == psutil.STATUS_ZOMBIE, 240, ignoring=(psutil.Error,))
    finally:
        pane.close()
    output = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [item["custom_id"] for item in output] == [r["custom_id"] for r in requests]
    assert all(item["response"]["status_code"] == 200 for item in output)
