"""An order from the gateway to a model's scheduler (sleep mode, LoRA adapters): its answer, or a 503
when no scheduler answers in time."""

from __future__ import annotations

import msgspec

from services.api.context import ApiContext
from services.api.errors import APIError
from shared.wire.messages import encode


async def order_scheduler(ctx: ApiContext, subject: str, order: msgspec.Struct, model: str, timeout_s: float) -> bytes:
    try:
        msg = await ctx.nc.request(subject, encode(order), timeout=timeout_s)
    except Exception as exc:  # no scheduler, or none answered in time
        raise APIError(503, f"the scheduler of `{model}` did not answer: {type(exc).__name__}",
                       code="unavailable") from None
    return msg.data
