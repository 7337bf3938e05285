"""Talking to NATS: the connection every service opens, the client library, liveness, service
endpoints and lifecycle, and the locked bus's users."""

from shared.bus.connection import close, connect, connect_running, replicas, servers

__all__ = ["close", "connect", "connect_running", "replicas", "servers"]
