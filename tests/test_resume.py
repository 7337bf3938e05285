"""A request resumed under a new leader, on a real nats-server with the scheduler and worker as
processes: a leader whose workers have not said hello yet holds it (--worker-grace-s) rather than
refuse it, and it goes on once one does, as a lone run of the same tokens would."""

from __future__ import annotations

import subprocess
import sys

import nats
import pytest

from shared.bus.client import BusClient
from shared.bus.stream import RequestStream
from shared.wire.messages import FinishReason, SamplingParams, Submit
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack
PROMPT = [1, 504, 3458, 282, 4649, 314]  # six tokens of SmolLM2's vocabulary
READ = [7, 8]  # the tokens the lost leader's stream had delivered


def _service(module: str, url: str, *args: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, "--nats-url", url, *args], stdout=log,
                            stderr=subprocess.STDOUT)


def _resumed(client: BusClient, model: str, max_tokens: int) -> RequestStream:
    """A stream as the client holds it when its leader is lost after READ was read."""
    stream = RequestStream(client, model, "r1")
    stream.submit = Submit(request_id="r1", model=model, prompt_token_ids=PROMPT, arrival_time=0.0,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           reply_to=client.reply_subject)
    stream.token_ids, stream.num_tokens = list(READ), len(READ)
    client.streams["r1"] = stream
    return stream


async def _read(stream: RequestStream) -> tuple[list[int], FinishReason | None, str | None]:
    tokens, last = [], None
    async for entry in stream.entries(timeout=120):
        tokens += entry.token_ids
        last = entry
    return tokens, last.finish_reason, last.error


async def test_a_leader_with_no_worker_yet_holds_a_resumed_request_until_one_says_hello(model_name, tmp_path):
    server = NatsServer().start()
    nc = await nats.connect(server.url)
    client = BusClient(nc)
    log = open(tmp_path / "services.log", "wb")
    procs = [_service("services.scheduler", server.url, "--worker-grace-s", "120", log=log)]  # a new leader
    try:
        await client.start()
        stream = _resumed(client, model_name, max_tokens=10)
        await client._resume(stream)  # accepted at once, though no worker has joined it
        assert stream.scheduler_id and stream.queue.empty()
        procs.append(_service("services.worker", server.url, "--kv-cache-memory-gib", "0.4", "--threads", "1",
                              "--worker-id", "w0", log=log))
        tokens, finish, error = await _read(stream)
        assert (finish, error) == (FinishReason.LENGTH, None)
        assert len(tokens) == 10 - len(READ)
        lone = await client.submit(model_name, PROMPT + READ, SamplingParams(max_tokens=10 - len(READ),
                                                                             temperature=0.0, ignore_eos=True))
        assert (await _read(lone))[0] == tokens  # as a lone run of the prompt and the tokens read
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        await nc.close()
        server.stop()
        log.close()


async def test_a_held_resumed_request_ends_with_an_error_when_no_worker_comes_within_the_grace(model_name, tmp_path):
    server = NatsServer().start()
    nc = await nats.connect(server.url)
    client = BusClient(nc)
    with open(tmp_path / "scheduler.log", "wb") as log:
        scheduler = _service("services.scheduler", server.url, "--worker-grace-s", "1", log=log)
        try:
            await client.start()
            stream = _resumed(client, model_name, max_tokens=10)
            await client._resume(stream)
            tokens, finish, error = await _read(stream)
            assert (tokens, finish) == ([], FinishReason.ERROR)
            assert error == (f"no worker of {model_name!r} could take the request for 1s (--worker-grace-s); "
                             "retry it")
        finally:
            scheduler.kill()
            scheduler.wait()
            await nc.close()
            server.stop()
