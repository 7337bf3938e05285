"""A request resumed under a new leader, on a real nats-server: a leader that has not heard from
its workers yet answers UNAVAILABLE, and the client asks again until the resume window closes."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.scheduler.service import SchedulerService
from shared.bus import client as client_module
from shared.bus.client import BusClient
from shared.bus.stream import RequestStream
from shared.config import EngineConfig
from shared.wire import subjects
from shared.wire.messages import FinishReason, SamplingParams, Submit
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack


async def test_a_resume_refused_for_want_of_workers_is_asked_again_until_the_window_closes(monkeypatch):
    monkeypatch.setattr(client_module, "RESUME_WITHIN_S", 2.0)
    server = NatsServer().start()
    nc = await nats.connect(server.url)
    scheduler = SchedulerService(nc, EngineConfig(model="m"), scheduler_id="standby")  # no worker has joined it
    client = BusClient(nc)
    tries = asyncio.Queue()

    async def on_try(msg):  # a copy of each Submit the client sends
        tries.put_nowait(msg)

    await nc.subscribe(subjects.submit("m"), cb=on_try)
    try:
        await scheduler.start()
        await client.start()
        stream = RequestStream(client, "m", "r1")
        stream.submit = Submit(request_id="r1", model="m", prompt_token_ids=[1, 2, 3], arrival_time=0.0,
                               sampling=SamplingParams(max_tokens=8), reply_to=client.reply_subject)
        stream.token_ids = [7, 8]  # read from the lost leader
        client.streams["r1"] = stream
        await client._resume(stream)
        assert tries.qsize() >= 3  # refused, asked again, and again: not failed at the first refusal
        entry = stream.queue.get_nowait()
        assert entry.finish_reason == FinishReason.ERROR
        assert entry.error == ("the scheduler holding this request stopped and it could not be resumed: "
                               "no worker is ready for model 'm'")
    finally:
        await scheduler.stop()
        await nc.close()
        server.stop()
