"""The FastAPI gateway: OpenAI-compatible routes, errors in OpenAI's shape, health and models."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.routes_openai import router as openai_router
from shared import subjects
from shared.messages import SCHEDULER_STATS_DECODER, SchedulerStatsRequest, encode


def create_app(make_context: Callable[[], Awaitable[ApiContext]],
               close_context: Callable[[ApiContext], Awaitable[None]]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.ctx = await make_context()
        yield
        await close_context(app.state.ctx)

    app = FastAPI(title="Switchyard", lifespan=lifespan)
    app.include_router(openai_router)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}",
                        param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx: ApiContext = request.app.state.ctx
        for name in ctx.models:
            try:
                msg = await ctx.nc.request(subjects.scheduler_stats(name), encode(SchedulerStatsRequest()), timeout=1.0)
            except Exception:
                return APIError(503, f"no scheduler answers for {name!r}").response()
            if SCHEDULER_STATS_DECODER.decode(msg.data).num_workers == 0:
                return APIError(503, f"no worker is ready for {name!r}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        ctx: ApiContext = request.app.state.ctx
        data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "switchyard",
                 "root": m.name, "parent": None, "max_model_len": m.max_model_len} for m in ctx.models.values()]
        return JSONResponse({"object": "list", "data": data})

    return app
