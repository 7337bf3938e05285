"""vLLM's sleep mode on the stack: /sleep frees the worker's weights (its resident memory falls) and
KV pool (its mapping goes), a stream in flight and a request sent while asleep wait, and after
/wake_up both finish with a lone run's greedy text."""

from __future__ import annotations

import asyncio
import os

import httpx
import nats
import pytest

from bench.memory import status_mib
from tests.bus_helpers import scheduler_stats

pytestmark = pytest.mark.stack
BODY = {"prompt": "Tell me about the sea.", "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}


async def _sleep_states(http: httpx.AsyncClient) -> dict[str, float]:
    """vLLM's vllm:engine_sleep_state gauge from /metrics, by its sleep_state label."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get("/metrics")).text
    return {s.labels["sleep_state"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "vllm:engine_sleep_state" for s in f.samples}


async def test_sleep_frees_the_workers_memory_and_what_waited_finishes_after_the_wake(
        stack, model_name, async_openai_client, default_model_path):
    worker = stack.service("worker-0").proc.pid
    lone = (await async_openai_client.completions.create(model=model_name, **BODY)).choices[0].text
    awake, awake_mapped = status_mib(worker), status_mib(worker, "VmSize")
    stream = await async_openai_client.completions.create(model=model_name, stream=True, **BODY)
    streamed = [(await anext(stream)).choices[0].text]  # in flight when the model falls asleep
    nc = await nats.connect(stack.admin_url)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        assert (await http.post("/sleep", params={"level": 1})).json() == {"is_sleeping": True}
        try:
            assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
            assert await _sleep_states(http) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
            asleep, asleep_mapped = status_mib(worker), status_mib(worker, "VmSize")
            later = asyncio.create_task(async_openai_client.completions.create(model=model_name, **BODY))
            async with asyncio.timeout(30):  # the stream's request and the new one wait in the queue
                while (await scheduler_stats(nc, model_name)).num_waiting < 2:
                    await asyncio.sleep(0.05)
            assert not later.done() and (await scheduler_stats(nc, model_name)).num_running == 0
        finally:
            woke = await http.post("/wake_up")
        assert woke.json() == {"is_sleeping": False}
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert await _sleep_states(http) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    streamed += [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(streamed) == lone and (await later).choices[0].text == lone
    print(f"worker RSS: awake {awake:.0f} MiB, asleep {asleep:.0f} MiB, woken {status_mib(worker):.0f} MiB; "
          f"mapped: awake {awake_mapped:.0f} MiB, asleep {asleep_mapped:.0f} MiB")
    assert asleep < awake - os.path.getsize(default_model_path) / 2**20  # the weights: the GGUF's blocks, ~1x the file
    assert asleep_mapped < awake_mapped - 0.4 * 1024  # the KV pool's mapping (--kv-cache-memory-gib 0.4), unmapped
    await nc.close()


async def test_sleep_mode_answers_bad_orders_by_name(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        assert (await http.post("/sleep", params={"level": 3})).status_code == 400
        assert (await http.post("/wake_up", params={"tags": "weights"})).status_code == 400
        assert (await http.post("/sleep", params={"model": "no-such-model"})).status_code == 404
        assert (await http.post("/wake_up")).json() == {"is_sleeping": False}  # awake already: nothing to do


async def _ready_status(http: httpx.AsyncClient, status: int) -> httpx.Response:
    """/ready until it answers `status` (its verdict is cached for a second, and a probe takes up
    to --ready-timeout-s)."""
    async with asyncio.timeout(60):
        while (answer := await http.get("/ready")).status_code != status:
            await asyncio.sleep(0.2)
    return answer


async def test_ready_generates_so_a_sleeping_model_is_not_ready_while_health_says_ok(stack, model_name):
    """/health answers 200 while no token flows (the model asleep: its requests wait); /ready runs a
    one-token generation, so it says 503, and 200 again once the model is awake. /live asks nothing."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        ready = await http.get("/ready")
        assert ready.status_code == 200 and ready.json()["models"][model_name]["ready"] is True
        assert (await http.post("/sleep", params={"level": 1})).json() == {"is_sleeping": True}
        try:
            not_ready = (await _ready_status(http, 503)).json()
            assert not_ready["error"]["code"] == "not_ready" and not_ready["error"]["type"] == "service_unavailable"
            assert not_ready["models"][model_name]["ready"] is False
            assert "no token within" in not_ready["models"][model_name]["error"]
            assert (await http.get("/health")).status_code == 200  # the failure /ready exists for
            assert (await http.get("/live")).json() == {"status": "alive"}
        finally:
            assert (await http.post("/wake_up")).json() == {"is_sleeping": False}
        assert (await _ready_status(http, 200)).json()["models"][model_name]["ready"] is True
