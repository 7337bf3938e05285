"""Connecting to NATS the same way in every service: reconnect forever with backoff."""

from __future__ import annotations

import nats
from nats.aio.client import Client

from shared.log import get_logger

log = get_logger("bus")


async def connect(url: str, name: str) -> Client:
    async def on_disconnect() -> None:
        log.warning("nats_disconnected", service=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", service=name)

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", service=name, error=str(exc))

    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )


async def close(nc: Client) -> None:
    """Drain if the server is still there; otherwise just close. Shutdown must never raise."""
    try:
        await nc.drain()
    except Exception:
        await nc.close()
