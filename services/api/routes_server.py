"""The server's own routes: /health, /ready, /live, /v1/models, /tokenize, /detokenize, /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.api.context import ApiContext
from services.api.errors import APIError
from services.api.media.prompt import store_images
from services.api.off_loop import off_loop
from services.api.openai.body import parse, read_json
from services.api.openai.params import check_token_ids, encode_text, render_messages
from services.api.openai.protocol import DetokenizeRequest, TokenizeRequest
from services.api.openai.routes import chat, complete
from shared.wire import subjects
from shared.wire.messages import encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStatsRequest

router = APIRouter()
VERSION = "0.2.0"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the model the gateway was started with has a scheduler with a worker; 503 otherwise,
    or while draining. Deployed pipelines report their own readiness (pipelines/status)."""
    ctx: ApiContext = request.app.state.ctx
    if ctx.server.is_draining:
        return APIError(503, "the server is shutting down", code="draining").response()
    for name in [m.name for m in ctx.models.values() if m.pipeline is None]:
        try:
            msg = await ctx.nc.request(subjects.scheduler_stats(name), encode(SchedulerStatsRequest()), timeout=1.0)
        except Exception:
            return APIError(503, f"no scheduler answers for {name!r}").response()
        stats = SCHEDULER_STATS_DECODER.decode(msg.data)
        if stats.num_workers == 0:
            return APIError(503, f"no worker is ready for {name!r}").response()
        # ready implies the gateway knows the model's limit
        ctx.limits.apply(name, stats)
        if stats.is_draining:
            return APIError(503, f"the scheduler for {name!r} is shutting down").response()
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness that generates: 200 when every model the gateway was started with gave one token
    (or one embedding) through its scheduler and workers, checked at most once a second
    (readiness.py); 503 with each model's failure otherwise, or while draining. The probe for a
    load balancer or a kubelet's readinessProbe: /health answers 200 while no token flows."""
    ctx: ApiContext = request.app.state.ctx
    if ctx.server.is_draining:
        return APIError(503, "the server is shutting down", code="draining").response()
    verdict = await ctx.server.readiness.check(ctx)
    models = {name: {"ready": v.ok, "latency_ms": round(v.latency_s * 1000, 1), **({"error": v.error} if v.error else {})}
              for name, v in verdict.items()}
    failed = [f"{name}: {v.error}" for name, v in verdict.items() if not v.ok]
    if failed:
        error = APIError(503, "not ready: " + "; ".join(failed), code="not_ready")
        return JSONResponse({**error.body(), "models": models}, status_code=503)
    return JSONResponse({"status": "ready", "models": models})


@router.get("/live")
async def live() -> JSONResponse:
    """Liveness: the gateway's event loop answers. It asks nothing of the bus or the engine, so a
    stalled bus or a busy model never gets a healthy gateway restarted (a kubelet's livenessProbe)."""
    return JSONResponse({"status": "alive"})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx: ApiContext = request.app.state.ctx
    for model in [m for m in ctx.models.values() if not m.max_model_len]:
        await ctx.limits.refresh(model.name)
    data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "switchyard",
             "root": m.name, "parent": None, "max_model_len": m.max_model_len or None, "devices": m.devices,
             "architectures": m.architectures}
            for m in ctx.models.values()]
    data += [{"id": info.name, "object": "model", "created": m.created, "owned_by": "switchyard", "root": info.path,
              "parent": m.name, "max_model_len": m.max_model_len or None, "devices": m.devices,
              "architectures": m.architectures}  # vLLM's: an adapter's root is its path, its parent the base
             for m in ctx.models.values() for info in m.loras]
    return JSONResponse({"object": "list", "data": data})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> JSONResponse:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does."""
    ctx: ApiContext = request.app.state.ctx
    served = ctx.resolve(model) if model else next(iter(ctx.models.values()), None)
    if served is None:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    tok = served.tokenizer
    return JSONResponse({"model": served.name, "tokenizer_class": "PreTrainedTokenizerFast",
                         "vocab_size": tok.vocab_size, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                         "model_max_length": served.max_model_len or None, "chat_template": served.chat_template})


@router.get("/load")
async def load(request: Request) -> JSONResponse:
    """vLLM's /load: the requests this gateway is serving now, this one not counted."""
    return JSONResponse({"server_load": request.app.state.ctx.server.num_in_flight - 1})


@router.post("/invocations")
async def invocations(request: Request):
    """SageMaker's route, as vLLM serves it: a body with `messages` is a chat, one with `prompt` a completion."""
    ctx: ApiContext = request.app.state.ctx
    raw = await read_json(request, ctx.server.max_body_bytes)
    if "messages" in raw:
        return await chat(request)
    if "prompt" in raw:
        return await complete(request)
    raise APIError(400, "an invocation needs `messages` (a chat) or `prompt` (a completion)", param="messages")


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": VERSION})


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""
    ctx, model, body = await parse(request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.tools is not None and body.messages is None:
        raise APIError(400, "tools are rendered with chat messages; a prompt takes none", param="tools")
    if body.prompt is not None:
        text = body.prompt
    else:
        # measured, not stored: their sizes (and crops) set their tokens
        images = await store_images(ctx, model, body.messages, body.mm_processor_kwargs, store=False)
        text = await off_loop(render_messages, model, body.messages, body.add_generation_prompt, body.tools,
                              body.continue_final_message, body.chat_template_kwargs, images)
    special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = await off_loop(encode_text, model, text, "prompt", special)
    strs = [model.tokenizer.token_string(i) for i in ids] if body.return_token_strs else None  # null: vLLM's
    return JSONResponse({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    _, model, body = await parse(request, DetokenizeRequest)
    check_token_ids(body.tokens, model, "tokens")
    return JSONResponse({"prompt": model.tokenizer.decode(body.tokens, skip_special_tokens=False)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: ApiContext = request.app.state.ctx
    lines = ctx.metrics.exposition()
    engine = await ctx.metrics.collect_engine(ctx.nc, list(ctx.models))
    lines += generate_latest(_Families(engine))
    return Response(lines, media_type=CONTENT_TYPE_LATEST)


class _Families:
    """A one-shot collector over families gathered at scrape time."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)
