"""Headless Chromium (Debian's package) driven over its DevTools protocol: pages as a person's
browser renders them, scripts and their requests included, with an Authorization header on
every request (credentials in the URL would make Chromium block the page's own requests)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from websockets.sync.client import ClientConnection, connect

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Page:
    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One protocol command's result (events that arrive meanwhile are passed over)."""
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._socket.recv(timeout=60))
            if reply.get("id") == call_id:
                assert "error" not in reply, reply
                return reply.get("result", {})

    def text(self) -> str:
        """The text the page shows now."""
        result = self.call("Runtime.evaluate", expression="document.body.innerText",
                           returnByValue=True)
        return str(result["result"].get("value", ""))

    def open(self, url: str, showing: str, timeout: float = 30) -> str:
        """Load `url` and return its text once it shows `showing` (its scripts may fill it
        in after the load); AssertionError with the text at the deadline."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while showing not in (text := self.text()):
            assert time.monotonic() < deadline, f"{url} never showed {showing!r}:\n{text}"
            time.sleep(0.25)
        return text


@contextmanager
def chromium_page(headers: dict[str, str]) -> Iterator[Page]:
    """A page of a fresh headless Chromium that sends `headers` with every request."""
    binary = shutil.which("chromium")
    assert binary, "Debian's chromium package is missing: run ops/test-tools.sh as root"
    with tempfile.TemporaryDirectory() as profile:
        process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert process.stderr is not None
            address = None
            for line in process.stderr:
                if found := _LISTENING.search(line):
                    address = found.group(1)
                    break
            assert address, "Chromium did not open its DevTools port"
            # Keep reading what it says, so that its pipe never fills and stalls it.
            threading.Thread(target=process.stderr.read, daemon=True).start()
            port = address.split(":")[2].split("/")[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                        timeout=10) as response:
                target = next(t for t in json.load(response) if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=None) as socket:
                page = Page(socket)
                page.call("Network.enable")
                page.call("Network.setExtraHTTPHeaders", headers=headers)
                page.call("Page.enable")
                yield page
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
