"""Each model's context limit as its scheduler publishes it: the workers own max_model_len, the
scheduler takes it from their hellos, and the gateway only reads it (0 while no worker serves)."""

from __future__ import annotations

from nats.aio.msg import Msg

from services.api.context import ApiContext
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.messages import MODEL_LIMITS_DECODER, ModelLimits, encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStats, SchedulerStatsRequest

log = get_logger("api")


class LimitsWatcher:
    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.ctx.nc.subscribe(subjects.MODEL_LIMITS, cb=self._on_limits)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def refresh(self, model: str) -> None:
        """Ask the model's scheduler once (a gateway that starts after the workers joined)."""
        try:
            msg = await self.ctx.nc.request(subjects.scheduler_stats(model), encode(SchedulerStatsRequest()),
                                            timeout=1.0)
        except Exception:  # no scheduler yet: it publishes when its first worker joins
            return
        stats = SCHEDULER_STATS_DECODER.decode(msg.data)
        self.apply(model, stats)

    def apply(self, model: str, limits: ModelLimits | SchedulerStats) -> None:
        """What the model's workers announced, as its scheduler publishes (ModelLimits) or answers it."""
        served = self.ctx.models.get(model)
        if served is not None:
            served.devices, served.architectures = limits.devices, limits.architectures
            served.embedding, served.images, served.loras = limits.embedding, limits.images, limits.loras or []
            if served.max_model_len != limits.max_model_len:
                served.max_model_len = limits.max_model_len
                log.info("model_limits", model=model, max_model_len=limits.max_model_len, devices=limits.devices)

    async def _on_limits(self, msg: Msg) -> None:
        limits = MODEL_LIMITS_DECODER.decode(msg.data)
        self.apply(limits.model, limits)
