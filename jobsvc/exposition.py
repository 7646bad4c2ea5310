"""Metrics as Prometheus asks for them, with their names as registered.

Prometheus asks for OpenMetrics first. prometheus_client then escapes its sample names for
the `underscores` scheme even where the name is already valid there, so vLLM's
`vllm:num_requests_running` reached Prometheus as `vllm_num_requests_running`, and every query
or dashboard panel naming `vllm:*` found nothing. Names valid in the classic character set
(letters, digits, `_` and `:`) need no escaping under any scheme a scraper may ask for, so
every format is rendered here with names left as they are; every name the registries hold is
of that set."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.registry import Collector


def exposition(registry: Collector, accept: str = "") -> tuple[bytes, str]:
    """The registry in the format the `Accept` header asks for (the classic text format when
    it asks for none we know), and the content type to serve it with."""
    encoder, content_type = choose_encoder(accept)
    if isinstance(encoder, partial) and "escaping" in encoder.keywords:
        encoder = partial(encoder, escaping=ALLOWUTF8)
    return encoder(registry), content_type


def _wsgi_app(registry: Collector) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body, content_type = exposition(registry, environ.get("HTTP_ACCEPT", ""))
        start_response("200 OK", [("Content-Type", content_type),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line each."""


def serve_registry(registry: Collector, address: str, port: int) -> None:
    """Serve `registry` over HTTP on `address`:`port` from a daemon thread; OSError if the
    port cannot be had."""
    server = make_server(address, port, _wsgi_app(registry), server_class=_ThreadingServer,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
