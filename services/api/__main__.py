"""python -m services.api: the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import argparse
import functools
import sys
import time

import uvicorn

from services.api.app import create_app
from services.api.context import ApiContext, BatchState, PipelineState, ServedModel, ServerState
from services.api.limits import LimitsWatcher
from services.api.media.fetch import MediaPolicy
from services.api.openai.defaults import load_openai_config
from services.api.pipelines.deployments import DeploymentWatcher
from services.api.pipelines.inference_log import InferenceLog, recorder
from services.api.processes import Supervisor, reuse_port_socket
from services.api.readiness import Readiness
from services.api.server import DrainingServer
from shared import bus
from shared import log as sylog
from shared.bus import connect
from shared.bus.client import BusClient
from shared.config import (
    add_engine_args,
    add_nats_arg,
    engine_config_from_args,
)
from shared.control.registry import Registry
from shared.gateway_config import add_api_args
from shared.models.model_files import resolve_model_path
from shared.models.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard API gateway")
    add_engine_args(parser)
    add_nats_arg(parser)
    add_api_args(parser)
    args, _ = parser.parse_known_args()  # the launcher passes every service the same flags
    config = engine_config_from_args(args)
    sylog.configure("api")
    if args.api_processes < 1:
        parser.error(f"--api-processes must be at least 1, got {args.api_processes}")
    if args.batch_concurrency < 1:
        parser.error(f"--batch-concurrency must be at least 1, got {args.batch_concurrency}")
    if args.inference_log_max_age_s <= 0 or args.inference_log_max_bytes <= 0:
        parser.error("--inference-log-max-age-s and --inference-log-max-bytes must be positive")
    if args.api_processes > 1:
        sys.exit(Supervisor(sys.argv[1:], args.api_processes).run())
    tokenizer = load_tokenizer(resolve_model_path(config.model_path, config.revision, config.download_dir))
    served = ServedModel(name=config.model, tokenizer=tokenizer, created=int(time.time()),
                         openai=load_openai_config(args.openai_config), max_logprobs=args.max_logprobs)
    api_keys = tuple(k for k in (args.api_key or "").split(",") if k)

    async def make_context() -> ApiContext:
        nc = await connect(args.nats_url, "api")
        client = BusClient(nc)
        await client.start()
        server = ServerState(idle_timeout_s=args.idle_timeout_s, request_timeout_s=args.request_timeout_s,
                             max_body_bytes=args.max_body_bytes, api_keys=api_keys,
                             per_request_metrics=args.enable_per_request_metrics,
                             limit_images=args.limit_mm_per_prompt["image"],
                             mm_processor_kwargs=args.mm_processor_kwargs,
                             media=MediaPolicy(timeout_s=args.media_fetch_timeout_s, max_bytes=args.max_media_bytes,
                                               allowed_domains=tuple(d.lower() for d in args.allowed_media_domains),
                                               allow_private=args.allow_private_media_urls),
                             readiness=Readiness(timeout_s=args.ready_timeout_s))
        pipelines = PipelineState(registry=await Registry(nc).open(), oci_registry=args.oci_registry,
                                  inference_log=InferenceLog(nc, args.inference_log_max_age_s,
                                                             args.inference_log_max_bytes))
        ctx = ApiContext(nc=nc, bus=client, models={served.name: served}, server=server, pipelines=pipelines,
                         batch=BatchState(concurrency=args.batch_concurrency), tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser)
        ctx.request_hooks.append(functools.partial(recorder, pipelines.inference_log))
        ctx.limits = LimitsWatcher(ctx)
        await ctx.limits.start()
        await ctx.limits.refresh(served.name)
        ctx.pipelines.watcher = DeploymentWatcher(ctx)
        ctx.pipelines.watcher.start()
        return ctx

    async def close_context(ctx: ApiContext) -> None:
        await ctx.pipelines.inference_log.flush()
        await ctx.pipelines.watcher.stop()
        await ctx.limits.stop()
        await ctx.bus.stop()
        await bus.close(ctx.nc)

    app = create_app(make_context, close_context)
    # uvloop and httptools: the C event loop and HTTP parser rather than uvicorn's pure-Python h11
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", loop="uvloop",
                               http="httptools")
    sockets = [reuse_port_socket(args.host, args.port)] if args.reuse_port else None
    DrainingServer(uv_config, app, grace_s=config.drain_grace_s).run(sockets=sockets)


if __name__ == "__main__":
    main()
