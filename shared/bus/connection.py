"""Connecting to NATS the same way in every service: its own user, TLS when asked, any server of a
cluster, reconnect forever; and how many copies the JetStream stores keep (SY_NATS_REPLICAS)."""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

import nats
from nats.aio.client import Client

from shared.bus.nats_auth import credentials
from shared.log import get_logger
from shared.models.model_files import cache_root

log = get_logger("bus")


def servers(url: str) -> list[str]:
    """A --nats-url of one server or of a cluster's, comma-separated (nats://a:4222,nats://b:4222):
    the client tries them in turn, reconnects to any, and learns the rest from the cluster."""
    found = [u.strip() for u in url.split(",") if u.strip()]
    if not found:
        raise ValueError(f"no NATS server in {url!r}")
    return found


def replicas() -> int:
    """Copies of each JetStream store (the registry, inference logs, Files/Batch, Responses): 1 on
    one server, 3 on a three-node cluster (the launcher's --nats-cluster, compose, deploy/k8s set it).
    Applied when a store is made; a store made before keeps its own."""
    value = int(os.environ.get("SY_NATS_REPLICAS", "1"))
    if not 1 <= value <= 5:  # JetStream's own bounds
        raise ValueError(f"SY_NATS_REPLICAS must be 1 to 5, got {value}")
    return value


async def connect(url: str, name: str) -> Client:
    async def on_disconnect() -> None:
        log.warning("nats_disconnected", service=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", service=name)

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", service=name, error=str(exc))

    login = credentials()  # SY_NATS_USER's password from SY_NATS_AUTH_FILE (shared/bus/nats_auth.py)
    extra = {"user": login[0], "password": login[1]} if login else {}
    if (ca := os.environ.get("SY_NATS_TLS_CA")) is not None:  # the bus leaves the host: verify its server
        tls = ssl.create_default_context(cafile=ca)
        if (cert := os.environ.get("SY_NATS_TLS_CERT")) is not None:
            tls.load_cert_chain(cert, os.environ.get("SY_NATS_TLS_KEY"))
        extra["tls"] = tls
    return await nats.connect(
        servers(url),
        name=name,
        **extra,
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


async def connect_running(user: str = "client", bus_file: str | Path | None = None) -> Client:
    """The bus of the stack `make run` started on this machine, as `user` (an internal team's
    process is a "client": it may submit and read its tokens; docs/configuration.md)."""
    path = Path(bus_file) if bus_file else cache_root() / "bus.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is `make run` running (on a bus of its own)?")
    bus = json.loads(path.read_text())
    login = credentials(user, bus["auth_file"])
    return await nats.connect(servers(bus["url"]), name=f"{user}-script", user=login[0], password=login[1],
                              max_reconnect_attempts=-1, reconnect_time_wait=0.5)
