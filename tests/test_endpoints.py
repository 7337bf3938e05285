"""The services' bus handlers as micro endpoints, on the running stack: a handler that raises answers
with micro's error headers and the service goes on; `$SRV.STATS` counts each endpoint."""

from __future__ import annotations

import json

import nats
import pytest

from shared.bus.endpoints import ERROR_CODE_HEADER, error_of
from shared.wire import subjects
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack


async def _stats(nc, service: str) -> dict:
    msg = await nc.request(subjects.service_stats(service, ""), b"", timeout=5)
    reply = json.loads(msg.data)
    assert reply["type"] == "io.nats.micro.v1.stats_response" and reply["name"] == service
    return {e["name"]: e for e in reply["endpoints"]}


async def test_a_handler_that_raises_answers_an_error_counts_it_and_the_service_goes_on(stack, openai_client,
                                                                                         model_name):
    openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=2)
    nc = await nats.connect(stack.admin_url)
    reply = await nc.request(subjects.abort(model_name), b"\x00 not an Abort", timeout=5)
    assert reply.headers[ERROR_CODE_HEADER] == "400" and error_of(reply).startswith("400 ValidationError: Expected")
    lookup = await nc.request(subjects.KV_LOOKUP, b"nor a lookup", timeout=5)
    assert error_of(lookup).startswith("400")

    assert (await scheduler_stats(nc, model_name)).num_workers == 1  # still serving
    assert openai_client.completions.create(model=model_name, prompt="Hello", max_tokens=2).choices[0].text
    scheduler = await _stats(nc, "scheduler")
    assert scheduler["abort"]["num_errors"] >= 1 and "ValidationError" in scheduler["abort"]["last_error"]
    assert scheduler["submit"]["num_requests"] >= 2 and scheduler["submit"]["num_errors"] == 0
    assert scheduler["submit"]["queue_group"] == f"scheduler.{model_name}" and scheduler["hello"]["queue_group"] == ""
    assert scheduler["stats"]["average_processing_time"] > 0
    worker = await _stats(nc, "worker")
    assert worker["step"]["num_requests"] >= 2 and worker["step"]["num_errors"] == 0
    assert (await _stats(nc, "kvcache"))["lookup"]["num_errors"] >= 1
    await nc.close()
