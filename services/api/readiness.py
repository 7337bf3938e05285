"""Readiness that generates: one token (or one embedding) through each served model, at most once a second."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.bus.client import EngineUnavailable, SubmitRejected
from shared.gateway_config import GATEWAY_DEFAULTS
from shared.wire.messages import FinishReason, Pooling, SamplingParams

if TYPE_CHECKING:
    from services.api.context import ApiContext, ServedModel

READY_CACHE_S = 1.0  # a probe storm (every replica's kubelet, a load balancer) runs one generation a second


@dataclass
class ModelReadiness:
    ok: bool
    latency_s: float
    error: str = ""


@dataclass
class Readiness:
    """The last verdict and when it was reached; concurrent probes wait for the one check in flight."""

    timeout_s: float = GATEWAY_DEFAULTS.ready_timeout_s  # a model that gives no token in this long is not ready
    checked_at: float = float("-inf")
    verdict: dict[str, ModelReadiness] = field(default_factory=dict)
    _running: asyncio.Future | None = None

    async def check(self, ctx: ApiContext) -> dict[str, ModelReadiness]:
        if time.monotonic() - self.checked_at < READY_CACHE_S:
            return self.verdict
        if self._running is None:
            self._running = asyncio.ensure_future(self._check_all(ctx))
        return await asyncio.shield(self._running)

    async def _check_all(self, ctx: ApiContext) -> dict[str, ModelReadiness]:
        try:
            models = [m for m in ctx.models.values() if m.pipeline is None]  # pipelines report their own
            verdicts = await asyncio.gather(*(self._generate(ctx, m) for m in models))
            self.verdict = dict(zip([m.name for m in models], verdicts, strict=True))
            self.checked_at = time.monotonic()
            return self.verdict
        finally:
            self._running = None

    async def _generate(self, ctx: ApiContext, model: ServedModel) -> ModelReadiness:
        """One greedy token from a one-token prompt, as any request would get it (same queue, same workers)."""
        started = time.monotonic()
        prompt = model.tokenizer.encode("Hello") or [0]
        sampling = SamplingParams(max_tokens=1, temperature=0.0, pooling=Pooling() if model.embedding else None)
        try:
            stream = await ctx.bus.submit(model.engine, prompt, sampling, deadline=time.time() + self.timeout_s,
                                          timeout=self.timeout_s, probe=True)
        except (EngineUnavailable, SubmitRejected) as exc:
            return ModelReadiness(False, time.monotonic() - started, str(exc))
        try:
            async with asyncio.timeout(self.timeout_s):
                async for entry in stream.entries():
                    if entry.finish_reason == FinishReason.TIMEOUT:  # the scheduler's deadline: ours
                        raise TimeoutError
                    if entry.finish_reason == FinishReason.ERROR:
                        return ModelReadiness(False, time.monotonic() - started, entry.error or "the engine failed")
                    if entry.token_ids or entry.embedding is not None:
                        await stream.abort()  # nothing more is needed of it
                        return ModelReadiness(True, time.monotonic() - started)
        except TimeoutError:
            await stream.abort()
            return ModelReadiness(False, time.monotonic() - started, f"no token within {self.timeout_s:g}s")
        return ModelReadiness(False, time.monotonic() - started, "the engine ended the request without a token")
