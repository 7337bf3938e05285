"""The FastAPI gateway: OpenAI-compatible routes, errors in OpenAI's shape, guards."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import nats.errors
import nats.js.errors
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.batch.routes_batches import router as batches_router
from services.api.batch.routes_files import router as files_router
from services.api.batch.runner import BatchRunner
from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.guards import Guards
from services.api.openai.body import validation_error
from services.api.openai.embeddings import router as embeddings_router
from services.api.openai.routes import router as openai_router
from services.api.openai.scores import router as scores_router
from services.api.pipelines.routes_infer import router as infer_router
from services.api.pipelines.routes_logs import router as pipeline_logs_router
from services.api.pipelines.routes_models import router as models_router
from services.api.pipelines.routes_pipelines import router as pipelines_router
from services.api.pipelines.routes_publish import router as publish_router
from services.api.responses.routes import router as responses_router
from services.api.routes_lora import router as lora_router
from services.api.routes_server import router as server_router
from services.api.routes_sleep import router as sleep_router
from shared.log import get_logger

log = get_logger("api")


# a store's request (JetStream: Files, Batch, Responses, the registry) unanswered: the bus, not a bug
BUS_UNAVAILABLE = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                   nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError)


def create_app(make_context: Callable[[], Awaitable[ApiContext]],
               close_context: Callable[[ApiContext], Awaitable[None]]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.ctx = await make_context()
        app.state.batch_runner = BatchRunner(app.state.ctx, app, app.state.ctx.batch.concurrency)
        app.state.batch_runner.start()
        yield
        await app.state.batch_runner.stop()
        await close_context(app.state.ctx)

    app = FastAPI(title="Switchyard", lifespan=lifespan)
    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(scores_router)
    app.include_router(responses_router)
    app.include_router(files_router)
    app.include_router(batches_router)
    app.include_router(server_router)
    app.include_router(sleep_router)
    app.include_router(lora_router)
    app.include_router(models_router)
    app.include_router(pipelines_router)
    app.include_router(pipeline_logs_router)
    app.include_router(publish_router)
    app.include_router(infer_router)
    app.add_middleware(Guards)

    def counted(error: APIError) -> JSONResponse:
        app.state.ctx.metrics.http_errors.labels(str(error.status)).inc()
        return error.response()

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return counted(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return counted(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return counted(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, BUS_UNAVAILABLE):  # a NATS node lost: JetStream elects new leaders in seconds
            log.warning("bus_unavailable", path=request.url.path, error=type(exc).__name__)
            return counted(APIError(503, "the bus did not answer in time (a NATS node may have just been lost); "
                                         "retry shortly", code="bus_unavailable", headers={"Retry-After": "1"}))
        log.exception("unhandled_error", path=request.url.path)
        return counted(APIError(500, f"internal error: {type(exc).__name__}"))

    return app
