"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, carried out by
the model's scheduler on every worker (services/scheduler/loras.py); `model` picks the base model
where the gateway serves several (default: the stack's own)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.openai.body import read_json, validate
from services.api.orders import order_scheduler
from shared.wire import subjects
from shared.wire.lora import LORA_STATE_DECODER, LoadLora, LoraOrder, UnloadLora

router = APIRouter()
ORDER_TIMEOUT_S = 120.0  # every worker reads and checks the adapter's files


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    model: str | None = None


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    model: str | None = None


async def _order(request: Request, cls, make) -> tuple[ApiContext, str]:
    ctx: ApiContext = request.app.state.ctx
    body = validate(cls, await read_json(request, ctx.server.max_body_bytes))
    if not body.lora_name.strip():
        raise APIError(400, "lora_name must name the adapter", param="lora_name")
    name = body.model or next(iter(ctx.models))
    base = ctx.models.get(name)
    if base is None:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    if body.lora_name in ctx.models:
        raise APIError(400, f"lora_name {body.lora_name!r} is a model's name", param="lora_name")
    order: LoraOrder = make(body)
    state = LORA_STATE_DECODER.decode(await order_scheduler(ctx, subjects.lora(base.name), order, base.name,
                                                            ORDER_TIMEOUT_S))
    base.loras = state.adapters  # this gateway knows at once; the others from the scheduler's limits
    if state.error:
        if state.not_found:
            raise APIError(404, state.error, param="lora_name", code="model_not_found")
        raise APIError(400, state.error, param="lora_name", code="invalid_lora")
    return ctx, body.lora_name


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    _, name = await _order(request, LoadLoraRequest, lambda b: LoadLora(b.lora_name, b.lora_path, b.load_inplace))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    _, name = await _order(request, UnloadLoraRequest, lambda b: UnloadLora(b.lora_name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
