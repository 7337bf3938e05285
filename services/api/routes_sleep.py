"""vLLM's sleep mode routes: POST /sleep?level=1, POST /wake_up, GET /is_sleeping, for the stack's
own model (or ?model=), carried out by its scheduler (services/scheduler/sleep_mode.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.orders import order_scheduler
from shared.wire import subjects
from shared.wire.messages import encode
from shared.wire.sleep import SLEEP_STATE_DECODER, Sleep, WakeUp
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStatsRequest

router = APIRouter()
ORDER_TIMEOUT_S = 120.0  # parking the pools and freeing (or loading) the workers' memory


def _model(request: Request) -> tuple[ApiContext, ServedModel]:
    ctx: ApiContext = request.app.state.ctx
    name = request.query_params.get("model") or next(iter(ctx.models))
    model = ctx.resolve(name)
    if model is None:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return ctx, model


async def _order(request: Request, order: Sleep | WakeUp) -> JSONResponse:
    ctx, model = _model(request)
    state = SLEEP_STATE_DECODER.decode(await order_scheduler(ctx, subjects.sleep(model.name), order, model.name,
                                                             ORDER_TIMEOUT_S))
    if state.error:
        raise APIError(500, f"sleep mode: {state.error}", code="sleep_failed")
    return JSONResponse({"is_sleeping": state.is_sleeping})


@router.post("/sleep")
async def sleep(request: Request) -> JSONResponse:
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise APIError(400, f"level must be 1 or 2, got {level!r}", param="level")
    return await _order(request, Sleep(level=int(level)))


@router.post("/wake_up")
async def wake_up(request: Request) -> JSONResponse:
    if "tags" in request.query_params:  # vLLM's partial wake (weights, then kv_cache): both come back together here
        raise APIError(400, "tags: the weights and the KV cache wake together here", param="tags")
    return await _order(request, WakeUp())


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    ctx, model = _model(request)
    try:
        msg = await ctx.nc.request(subjects.scheduler_stats(model.name), encode(SchedulerStatsRequest()), timeout=5)
    except Exception as exc:
        raise APIError(503, f"the scheduler of `{model.name}` did not answer: {type(exc).__name__}",
                       code="unavailable") from None
    return JSONResponse({"is_sleeping": SCHEDULER_STATS_DECODER.decode(msg.data).is_sleeping})
