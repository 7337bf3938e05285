"""uvicorn, drained: on SIGTERM the gateway answers 503 to new requests, lets the ones in flight
finish (up to the grace period), then stops. A second signal stops at once."""

from __future__ import annotations

import time

import uvicorn
from fastapi import FastAPI

from shared.log import get_logger

log = get_logger("api")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.drain_started: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_started is not None or not hasattr(self.app.state, "ctx"):
            return super().handle_exit(sig, frame)
        self.drain_started = time.monotonic()
        self.app.state.ctx.server.is_draining = True
        log.info("api_draining", num_in_flight=self.app.state.ctx.server.num_in_flight, grace_s=self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            is_idle = self.app.state.ctx.server.num_in_flight == 0
            if is_idle or time.monotonic() - self.drain_started > self.grace_s:
                self.should_exit = True
        return await super().on_tick(counter)
