"""`python -m bench.nats_fresh_subscriptions`: how often the NATS server misses a message to a subscription just made.

    python -m bench.nats_fresh_subscriptions [--count 20000] [--unlocked] [--new-connections] [--delay-ms 10]

A subscriber (the scheduler's user) subscribes to a fresh submit subject and flushes, so the server
holds the subscription; a publisher (the gateway's user) publishes to it and flushes; the subscriber
waits for the message. Debian's nats-server 2.9.10 on a locked bus (users in an account) missed a few
in 20,000 (docs/benchmarks.md, the 62nd VM); a missed one is counted after --wait-s, and a second copy
then shows whether the subscription works at all.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import nats

from shared.bus import nats_auth
from shared.wire import subjects
from switchyard.nats_server import NatsServer


async def _connect(server: NatsServer, user: str, errors: list[str]) -> nats.aio.client.Client:
    async def on_error(exc: Exception) -> None:
        errors.append(repr(exc))

    url = nats_auth.url_with_login(server.url, user, server.auth_dir) if server.auth_dir else server.url
    return await nats.connect(url, error_cb=on_error, allow_reconnect=False)


async def run(server: NatsServer, count: int, new_connections: bool, delay_s: float, wait_s: float) -> dict:
    errors: list[str] = []
    subscriber = publisher = None
    missed = recovered = 0
    started = time.perf_counter()
    for _ in range(count):
        if subscriber is None or new_connections:
            if subscriber is not None:
                await subscriber.close()
                await publisher.close()
            subscriber, publisher = await _connect(server, "scheduler", errors), await _connect(server, "api", errors)
        subject = subjects.submit(uuid.uuid4().hex)
        sub = await subscriber.subscribe(subject)
        await subscriber.flush()
        if delay_s:
            await asyncio.sleep(delay_s)
        await publisher.publish(subject, b"first")
        await publisher.flush()
        try:
            await sub.next_msg(timeout=wait_s)
        except nats.errors.TimeoutError:
            missed += 1
            await publisher.publish(subject, b"second")
            await publisher.flush()
            try:
                await sub.next_msg(timeout=wait_s)
                recovered += 1
            except nats.errors.TimeoutError:
                pass
        await sub.unsubscribe()
    await subscriber.close()
    await publisher.close()
    return {"messages": count, "missed": missed, "second copy arrived": recovered, "errors": len(errors),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000)
    p.add_argument("--unlocked", action="store_true", help="a server without users (the global account)")
    p.add_argument("--new-connections", action="store_true", help="two new connections for each message")
    p.add_argument("--delay-ms", type=float, default=0.0, help="between the subscriber's flush and the publish")
    p.add_argument("--wait-s", type=float, default=10.0, help="how long a message is waited for")
    args = p.parse_args()
    server = NatsServer(auth=not args.unlocked).start()
    try:
        print(asyncio.run(run(server, args.count, args.new_connections, args.delay_ms / 1e3, args.wait_s)))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
