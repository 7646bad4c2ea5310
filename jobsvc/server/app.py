"""The FastAPI application of `jobsvc serve`: one router per resource, one error shape, every
request inside its bounds (the key checked before any body is read), and the batch driver and
the webhooks' sender running for the app's life."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request, Response

from jobsvc.exposition import exposition
from jobsvc.server import batches, files
from jobsvc.server.bounds import RequestBounds
from jobsvc.server.errors import install_error_handlers
from jobsvc.server.models import Health, ModelList, ModelObject
from jobsvc.server.services import Services, services_of
from jobsvc.settings import Settings

_meta = APIRouter()


@_meta.get("/v1/models")
def list_models(request: Request) -> ModelList:
    """Every model and adapter the fleet serves or has served, so clients that ask before they
    send find their names."""
    services = services_of(request)
    models = services.client.models
    return ModelList(data=[ModelObject(
        id=model.name, created=services.started, root=model.weights, parent=model.base,
        max_model_len=models.prompts(model).context_length, task=model.task)
        for model in sorted(models.models().values(), key=lambda model: model.name)])


@_meta.get("/health")
def health() -> Health:
    """Answers while the server runs: what `ServerProcess` and load balancers wait on."""
    return Health()


@_meta.get("/metrics")
def metrics(request: Request) -> Response:
    """In the format the scraper asks for; behind the API key like every route."""
    body, content_type = exposition(services_of(request).metrics,
                                    request.headers.get("accept", ""))
    return Response(body, media_type=content_type)


def create_app(settings: Settings) -> FastAPI:
    """The server's app: request bounds outermost, one error shape, every router, and the services
    (the batch driver and the webhooks' sender among them) opened and closed with its life."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.open(settings)
        services.start_driver()
        services.start_webhooks()
        app.state.services = services
        try:
            yield
        finally:
            services.close()

    app = FastAPI(title="jobsvc", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.add_middleware(RequestBounds, api_key=settings.api_key,
                       upload_bytes=settings.max_upload_bytes,
                       read_timeout=settings.body_read_timeout)
    install_error_handlers(app)
    for router in (files.router, batches.router, _meta):
        app.include_router(router)
    return app


def serve(settings: Settings, host: str, port: int) -> None:
    """Run the server until interrupted."""
    import uvicorn

    uvicorn.run(create_app(settings), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=10)

