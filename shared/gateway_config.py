"""The gateway's settings: its defaults, each written once (GatewayConfig), and its flags."""

from __future__ import annotations

import argparse
import json

import msgspec

from shared.config import env_default, env_flag
from shared.wire.images import PAN_AND_SCAN_KEYS, PIXEL_RANGE_KEYS


class GatewayConfig(msgspec.Struct, frozen=True):
    """The gateway's defaults, each written once: its flags and its ServerState read them here."""

    idle_timeout_s: float = 300.0  # a request with no token for this long is aborted
    request_timeout_s: float = 600.0  # a request's deadline from its arrival (0: none)
    ready_timeout_s: float = 10.0  # /ready's one-token probe
    max_body_bytes: int = 16 * 2**20
    max_logprobs: int = 20
    limit_images_per_prompt: int = 999  # vLLM's --limit-mm-per-prompt default for each modality (V1)
    media_fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
    max_media_bytes: int = 20 * 2**20  # OpenAI's cap on an image input
    batch_concurrency: int = 16  # the Batch API's lines in flight at once
    inference_log_max_age_s: float = 7 * 24 * 3600.0  # pipelines' inference logs: older records dropped
    inference_log_max_bytes: int = 2**30  # and past this size, all together, the oldest


GATEWAY_DEFAULTS = GatewayConfig()


def _mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: {"image": N}, the one modality served (0: none)."""
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not all(
            isinstance(v, int) and v >= 0 for v in limits.values()):
        raise argparse.ArgumentTypeError(f'{text!r}: {{"image": N}} with N >= 0 (images are the one modality served)')
    return {"image": GATEWAY_DEFAULTS.limit_images_per_prompt} | limits


def _mm_processor_kwargs(text: str) -> dict:
    """--mm-processor-kwargs: a JSON object of the image processors' settings (a misspelt key is
    refused here, not dropped for every model)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: a JSON object")
    if unknown := sorted(set(value) - set(PIXEL_RANGE_KEYS) - set(PAN_AND_SCAN_KEYS)):
        raise argparse.ArgumentTypeError(f"{unknown}: not an image processor setting served here (takes "
                                         f"{', '.join(PIXEL_RANGE_KEYS + PAN_AND_SCAN_KEYS)})")
    return value


def add_api_args(parser: argparse.ArgumentParser) -> None:
    g = GATEWAY_DEFAULTS
    parser.add_argument("--host", default=env_default("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=env_default("port", "8000"))
    parser.add_argument("--api-processes", type=int, default=env_default("api_processes", "1"),
                        help="gateway processes sharing the port (SO_REUSEPORT), each with its own bus "
                             "client; they admit a burst of requests in parallel (default 1)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind the port with SO_REUSEPORT, beside other gateway processes")
    parser.add_argument("--idle-timeout-s", type=float, default=env_default("idle_timeout_s", g.idle_timeout_s),
                        help="a request with no token for this long is aborted")
    parser.add_argument("--request-timeout-s", type=float,
                        default=env_default("request_timeout_s", g.request_timeout_s),
                        help="server-side deadline of a request from its arrival (0: none)")
    parser.add_argument("--ready-timeout-s", type=float, default=env_default("ready_timeout_s", g.ready_timeout_s),
                        help="/ready: a model whose one-token probe gives no token in this long is not ready")
    parser.add_argument("--api-key", default=env_default("api_key", None),
                        help="comma-separated keys; when set, every route but /health, /ready and /live needs one")
    parser.add_argument("--max-body-bytes", type=int, default=env_default("max_body_bytes", g.max_body_bytes))
    parser.add_argument("--max-logprobs", type=int, default=env_default("max_logprobs", g.max_logprobs))
    parser.add_argument("--limit-mm-per-prompt", type=_mm_limits, metavar="JSON",
                        default=_mm_limits(env_default("limit_mm_per_prompt", json.dumps({"image": g.limit_images_per_prompt}))),
                        help=f'vLLM\'s: the most images one request may carry, as {{"image": N}} '
                             f"(default {g.limit_images_per_prompt}); more is a 400")
    parser.add_argument("--mm-processor-kwargs", type=_mm_processor_kwargs, metavar="JSON",
                        default=_mm_processor_kwargs(env_default("mm_processor_kwargs", "{}")),
                        help="vLLM's: image processor settings for every request, under each request's own "
                             "mm_processor_kwargs (Qwen2.5-VL's min_pixels, max_pixels; Gemma 3's do_pan_and_scan "
                             "and pan_and_scan_*); each model takes those its processor has (docs/images.md)")
    parser.add_argument("--media-fetch-timeout-s", type=float,
                        default=env_default("media_fetch_timeout_s", g.media_fetch_timeout_s),
                        help="an image URL's fetch, all of it, within this (default 5 s)")
    parser.add_argument("--max-media-bytes", type=int, default=env_default("max_media_bytes", g.max_media_bytes),
                        help="an image's file, fetched or in a data URL, at most this (default 20 MiB)")
    parser.add_argument("--allowed-media-domains", nargs="*", default=(env_default("allowed_media_domains", "") or "").split(),
                        help="vLLM's: the hosts an image URL may name (default: any public one)")
    parser.add_argument("--allow-private-media-urls", action="store_true",
                        default=env_flag("allow_private_media_urls", False),
                        help="let image URLs reach private, loopback and link-local addresses (default: refused, "
                             "as a URL fetcher inside a network is an SSRF door)")
    parser.add_argument("--enable-per-request-metrics", action="store_true",
                        default=env_flag("enable_per_request_metrics", False),
                        help="vLLM's: a `metrics` object (time to first token, queue time, generation time, "
                             "mean inter-token latency, tokens per second) in each completion and chat answer of "
                             "one choice, and on a stream's final usage chunk")
    parser.add_argument("--tool-call-parser", default=env_default("tool_call_parser", "auto"),
                        choices=("auto", "hermes", "json", "mistral"),
                        help="how a model's text becomes tool calls: hermes (<tool_call>{json}</tool_call>, "
                             "SmolLM2/Qwen/Hermes), json (Llama 3.x: the whole answer is a call or a list of "
                             "calls), mistral ([TOOL_CALLS][...]); auto (default): the chat template's own syntax")
    parser.add_argument("--reasoning-parser", default=env_default("reasoning_parser", None) or None,
                        choices=("deepseek_r1", "qwen3"),
                        help="where a chat answer's thinking is (<think>...</think>): it becomes the message's "
                             "reasoning_content (deepseek_r1: the answer starts thinking; qwen3: when it opens "
                             "<think>, or the template did); default: none")
    parser.add_argument("--batch-concurrency", type=int, default=env_default("batch_concurrency", g.batch_concurrency),
                        help="the Batch API: lines of one batch in flight at once, at low priority")
    parser.add_argument("--oci-registry", default=env_default("oci_registry", None),
                        help="where pipeline.publish() pushes: [http://|https://]host[:port][/namespace] "
                             "(https unless said; http for a local registry)")
    parser.add_argument("--inference-log-max-age-s", type=float,
                        default=env_default("inference_log_max_age_s", g.inference_log_max_age_s),
                        help="pipelines' inference logs: records older than this are dropped (default 7 days)")
    parser.add_argument("--inference-log-max-bytes", type=int,
                        default=env_default("inference_log_max_bytes", g.inference_log_max_bytes),
                        help="pipelines' inference logs, all together: past this the oldest are dropped (1 GiB)")
    parser.add_argument("--openai-config", default=env_default("openai_config", None),
                        help="per-model OpenAI defaults: JSON (or a JSON file) with completion_config "
                             "and chat_completion_config (which may carry chat_template)")
