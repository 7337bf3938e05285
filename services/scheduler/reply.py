"""What the scheduler itself sends to a request's reply subject: terminal error entries."""

from __future__ import annotations

import time

from nats.aio.client import Client

from services.scheduler.request import Request
from shared.wire.messages import FinishReason, TokenBatch, TokenEntry, encode


async def publish_error(nc: Client, request: Request, error: str | None,
                        reason: FinishReason = FinishReason.ERROR) -> None:
    """The request's final entry: an error, a deadline, or (error None) an abort."""
    entry = TokenEntry(request_id=request.request_id, offset=len(request.output_token_ids), token_ids=[],
                       produced_at=time.time(), finish_reason=reason, error=error)
    if entry.offset == 0:  # the stream's first entry: it carries the per-request constants
        entry.num_prompt_tokens = request.num_prompt_tokens
        entry.num_cached_tokens = request.num_cached_tokens
    await nc.publish(request.reply_to, encode(TokenBatch(entries=[entry])))
