"""The host KV tier in a stack of two workers (--kv-offloading-size): a conversation whose worker
was killed goes on on the other from the blocks the dead one wrote to the tier, with a lone run's
tokens; the KV index and /metrics say where the blocks are. Disaggregated prefill (a prefill and a
decode worker, --kv-transfer-config): each request handed on at its first token, its answer the
colocated stack's, and a decode worker killed mid-stream loses no token."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest

from shared.bus.client import BusClient
from shared.wire.messages import SamplingParams
from tests.test_two_workers import _wait_for_workers, kv_stats

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def tier_stack(tmp_path_factory, model_name):
    from tests.conftest import _start_stack

    # 24 blocks of 16 tokens a worker: a few conversations evict each other
    s = _start_stack(tmp_path_factory, "host-tier", num_workers=2,
                     extra_args=["--kv-offloading-size", "0.1", "--num-kv-blocks", "24", "--max-model-len", "384"])
    asyncio.run(_wait_for_workers(s.admin_url, model_name, 2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def disagg_stack(tmp_path_factory, model_name):
    from switchyard.launcher import Stack
    from switchyard.nats_server import NatsServer, free_port
    from tests.conftest import ready_or_stopped

    nats_server = NatsServer(auth=True).start()
    log_dir = tmp_path_factory.mktemp("disaggregated")
    stack = Stack(nats_url=nats_server.url, auth_dir=nats_server.auth_dir, api_port=free_port(), num_workers=0,
                  num_prefill_workers=1, num_decode_workers=1, log_dir=log_dir,
                  service_args=["--kv-cache-memory-gib", "0.4", "--threads", "1", "--kv-offloading-size", "0.1",
                                "--max-model-len", "384"])
    stack.nats = nats_server
    stack.start()
    s = ready_or_stopped(stack, log_dir)
    asyncio.run(_wait_for_workers(s.admin_url, model_name, 2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def two_host_stack(tmp_path_factory, model_name):
    """A prefill worker and a decode worker whose tiers are two files (two hosts' shared memory, as
    --kv-offloading-dir makes them), the decode worker in a network namespace of its own where this
    machine can make one (root; tests/hosts.py), reaching the bus over a veth pair: each handoff copies
    the prompt's blocks over the bus between two network stacks."""
    import json

    from switchyard.launcher import Stack
    from switchyard.nats_server import NatsServer, free_port
    from tests.conftest import ready_or_stopped
    from tests.hosts import Hosts, can_make_hosts

    netns = Hosts(["b"]).make() if can_make_hosts() is None else None
    nats_server = NatsServer(auth=True, host=f"{netns.subnet}.1" if netns else "127.0.0.1").start()
    log_dir = tmp_path_factory.mktemp("two-hosts")
    common = ["--kv-cache-memory-gib", "0.4", "--threads", "1", "--kv-offloading-size", "0.1", "--max-model-len", "384"]
    host_a, host_b = (tmp_path_factory.mktemp(h) for h in ("host-a", "host-b"))
    stack = Stack(nats_url=nats_server.url, auth_dir=nats_server.auth_dir, api_port=free_port(), num_workers=0,
                  num_prefill_workers=1, log_dir=log_dir, service_args=[*common, "--kv-offloading-dir", str(host_a)])
    stack.nats = nats_server
    stack.start()
    s = ready_or_stopped(stack, log_dir)
    s.add_worker("worker-decode-0", "--kv-offloading-dir", str(host_b),
                 "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"}),
                 wrapper=netns["b"].wrapper if netns else ())
    asyncio.run(_wait_for_workers(s.admin_url, model_name, 2))
    yield s
    s.stop()
    if netns:
        netns.remove()


async def _run(bus: BusClient, model: str, prompt: list[int], max_tokens: int, salt: str | None = None):
    stream = await bus.submit(model, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              cache_salt=salt)
    entries = [e async for e in stream.entries(timeout=120)]
    return stream.worker_id, entries[0].num_cached_tokens, [t for e in entries for t in e.token_ids]


async def _tier_blocks(nc) -> int:
    return sum(n for pool, n in (await kv_stats(nc)).items() if pool.startswith("host:"))


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.1)


async def test_a_conversation_goes_on_from_the_tier_after_its_worker_is_killed(tier_stack, model_name):
    nc = await nats.connect(tier_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    victim = None
    try:
        history = [2000 + i for i in range(100)]  # 6 full blocks
        home, cached, answer = await _run(bus, model_name, history, 12)
        assert cached == 0
        # written through by the Step after the one that computed them; the KV index hears of it
        await _until(lambda: _tier_blocks_at_least(nc, 6))
        victim = tier_stack.service(home)
        victim.proc.kill()
        victim.proc.wait(timeout=10)
        turn = history + answer + [3000 + i for i in range(20)]
        _, _, alone = await _run(bus, model_name, turn, 12, salt="alone")  # no cache of any kind
        worker, cached, got = await _run(bus, model_name, turn, 12)
        assert worker != home
        assert cached >= 96  # the history's blocks, the first 96 tokens at least, loaded from the tier
        assert got == alone
    finally:
        if victim is not None:
            victim.start(tier_stack._env(victim.name))
        await _wait_for_workers(tier_stack.admin_url, model_name, 2)
        await bus.stop()
        await nc.close()
    assert _tier_hits(tier_stack) >= 96


def _tier_hits(stack) -> float:
    metrics = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return float(next(line for line in metrics.splitlines()
                      if line.startswith("vllm:external_prefix_cache_hits_total")).split()[-1])


async def test_conversations_that_overflow_the_pool_come_back_from_the_tier(tier_stack, model_name):
    """Four conversations of 160 tokens against 24 blocks a worker: their blocks are evicted by the
    others' and loaded back from the tier; every later turn's answer is a lone run's."""
    nc = await nats.connect(tier_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    hits_before = _tier_hits(tier_stack)
    try:
        histories = [[10000 * (c + 1) + i for i in range(160)] for c in range(4)]
        for c, history in enumerate(histories):
            _, _, answer = await _run(bus, model_name, history, 8)
            history += answer + [500 + c] * 8
        for history in histories:
            _, _, alone = await _run(bus, model_name, history, 8, salt="alone")
            _, cached, got = await _run(bus, model_name, history, 8)
            assert got == alone and cached >= 160
    finally:
        await bus.stop()
        await nc.close()
    assert _tier_hits(tier_stack) - hits_before >= 160  # one conversation at least came back from the tier


async def _tier_blocks_at_least(nc, n: int) -> bool:
    try:
        return await _tier_blocks(nc) >= n
    except Exception:  # the index not answering yet
        return False


PROMPTS = [[4000 + 7 * i for i in range(n)] for n in (20, 57, 130)]


async def _answers(stack, model: str, max_tokens: int = 24) -> list[tuple[str, list[int]]]:
    nc = await nats.connect(stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    try:
        return [(w, t) for w, _, t in [await _run(bus, model, p, max_tokens) for p in PROMPTS]]
    finally:
        await bus.stop()
        await nc.close()


async def test_disaggregated_prefill_hands_each_request_to_the_decode_worker(disagg_stack, tier_stack, model_name):
    colocated = [tokens for _, tokens in await _answers(tier_stack, model_name)]
    answers = await _answers(disagg_stack, model_name)
    assert [tokens for _, tokens in answers] == colocated
    assert {worker for worker, _ in answers} == {"worker-decode-0"}  # the latest tokens came from the decode worker
    log = (disagg_stack.log_dir / "scheduler.log").read_text()
    assert '"worker_id": "worker-prefill-0"' in log and '"event": "request_routed"' in log
    assert _tier_hits(disagg_stack) >= 16  # the 130-token prompt's blocks at least, loaded by the decode worker


async def test_a_decode_worker_killed_mid_stream_loses_no_token(disagg_stack, model_name):
    """The decode worker SIGKILLed while it streams: the request goes back to the prefill worker,
    which decodes it on (no decode worker is left), and the stream ends with the lone run's tokens."""
    nc = await nats.connect(disagg_stack.admin_url)
    bus = BusClient(nc)
    await bus.start()
    victim = disagg_stack.service("worker-decode-0")
    prompt = [6000 + i for i in range(40)]
    try:
        _, _, alone = await _run(bus, model_name, prompt, 200, salt="alone")
        stream = await bus.submit(model_name, prompt, SamplingParams(max_tokens=200, temperature=0.0,
                                                                     ignore_eos=True))
        reader = stream.entries(timeout=120)
        got = []
        async for entry in reader:
            got += entry.token_ids
            if stream.worker_id == "worker-decode-0" and len(got) > 8:
                break
        victim.proc.kill()
        victim.proc.wait(timeout=10)
        got += [t for e in [e async for e in reader] for t in e.token_ids]
        assert got == alone
    finally:
        victim.start(disagg_stack._env(victim.name))
        await _wait_for_workers(disagg_stack.admin_url, model_name, 2)
        await bus.stop()
        await nc.close()


async def test_a_prefill_worker_on_another_host_hands_on_its_blocks_over_the_bus(two_host_stack, tier_stack,
                                                                                   model_name):
    """The decode worker's tier is not the prefill worker's: the scheduler has its worker copy the
    prompt's blocks from the other tier (KvFetch, chunks over NATS) before the request joins it."""
    colocated = [tokens for _, tokens in await _answers(tier_stack, model_name)]
    answers = await _answers(two_host_stack, model_name)
    assert [tokens for _, tokens in answers] == colocated
    assert {worker for worker, _ in answers} == {"worker-decode-0"}
    log = (two_host_stack.log_dir / "scheduler.log").read_text()
    assert '"event": "kv_fetched"' in log and '"event": "kv_fetch_failed"' not in log
    assert _tier_hits(two_host_stack) >= 16  # loaded from its own tier once fetched


def _client(stack):
    import openai

    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("hosts", ["disagg_stack", "two_host_stack"])
def test_an_outside_router_drives_prefill_and_decode_with_kv_transfer_params(hosts, request, tier_stack, model_name):
    """vLLM's disaggregated-prefill proxy, step for step with the openai client: the prefill request
    (max_tokens 1, do_remote_decode) answers where its prompt's blocks wait in the host tier; the
    decode request carrying those params loads them on the decode worker (over the bus from the
    other host's tier in two_host_stack); its answer is the colocated stack's. Params naming a
    prefill nobody holds recompute, with the same answer."""
    asyncio.run(_as_a_router(request.getfixturevalue(hosts), hosts, tier_stack, model_name))


async def _as_a_router(disagg_stack, hosts: str, tier_stack, model_name: str) -> None:
    salt = {"disagg_stack": 11, "two_host_stack": 12}[hosts]  # each stack's prompt its own
    prompt = [salt * 1000 + 7 * i for i in range(101)]  # 6 full blocks of 16 tokens no test computed before
    sampling = {"model": model_name, "prompt": prompt, "temperature": 0.0}
    colocated = await _client(tier_stack).completions.create(**sampling, max_tokens=16)
    client = _client(disagg_stack)
    hits_before = _tier_hits(disagg_stack)
    prefill = await client.completions.create(**sampling, max_tokens=1, extra_body={"kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    params = prefill.model_extra["kv_transfer_params"]
    assert prefill.choices[0].finish_reason == "length"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == 6 and params["remote_engine_id"]
    assert params["remote_request_id"] == prefill.id.removeprefix("cmpl-")
    decode = await client.completions.create(**sampling, max_tokens=16, extra_body={"kv_transfer_params": params})
    assert decode.choices[0].text == colocated.choices[0].text
    assert _tier_hits(disagg_stack) - hits_before >= 6 * 16  # the decode worker loaded the six blocks
    log = (disagg_stack.log_dir / "scheduler.log").read_text()
    routed = [line for line in log.splitlines() if '"request_routed"' in line]
    assert '"worker-decode-0"' in routed[-1] and '"worker-prefill-0"' in routed[-2]
    assert decode.model_extra["kv_transfer_params"] is None  # a decode request's answer carries none
    if hosts == "two_host_stack":
        assert '"event": "kv_fetched"' in log
    again = await client.completions.create(**sampling, max_tokens=1, extra_body={"kv_transfer_params": {
        "do_remote_decode": True}})  # every block cached and in the tier already: no Step saves them
    assert again.model_extra["kv_transfer_params"]["remote_block_ids"] == params["remote_block_ids"]
    unknown = dict(params, remote_request_id="nobody", remote_engine_id="nowhere")
    recomputed = await client.completions.create(**{**sampling, "prompt": [*prompt, 9]}, max_tokens=16,
                                                 extra_body={"kv_transfer_params": unknown})
    alone = await _client(tier_stack).completions.create(**{**sampling, "prompt": [*prompt, 9]}, max_tokens=16)
    assert recomputed.choices[0].text == alone.choices[0].text
    log = (disagg_stack.log_dir / "scheduler.log").read_text()
    assert '"event": "kv_transfer_not_held"' in log and '"remote_engine_id": "nowhere"' in log


async def test_kv_transfer_params_that_cannot_be_served_are_refused_by_name(tier_stack, model_name):
    import openai

    client = _client(tier_stack)
    cases = [({"do_remote_decode": True, "hostname": "x"}, {}, "unknown key 'hostname'"),
             ({"prompt_token_ids": [1, 2]}, {}, "a chat request's"),
             ({"do_remote_prefill": True, "remote_request_id": "x", "remote_host": "10.0.0.1"}, {}, "side channel"),
             ({"do_remote_prefill": True, "remote_block_ids": ["a"]}, {}, "list of integers"),
             ({"do_remote_prefill": True}, {}, "remote_request_id"),
             ({"do_remote_decode": True}, {"n": 2}, "one choice")]
    for params, extra, words in cases:
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(model=model_name, prompt="Hello", max_tokens=2,
                                            extra_body={"kv_transfer_params": params, **extra})
        assert words in str(error.value) and "kv_transfer_params" in str(error.value)


async def test_a_streamed_prefill_answers_its_params_on_its_last_chunk(tier_stack, model_name):
    """vLLM 0.33 streams a prefill request too: the chunk that finishes the choice carries them."""
    stream = await _client(tier_stack).completions.create(
        model=model_name, prompt=[5000 + i for i in range(40)], max_tokens=1, temperature=0.0, stream=True,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    chunks = [chunk async for chunk in stream]
    last = next(c for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    params = last.model_extra["kv_transfer_params"]
    assert last.choices[0].finish_reason == "length" and params["do_remote_prefill"]
    assert len(params["remote_block_ids"]) == 2  # 40 tokens: two full blocks of 16


async def test_a_decode_chat_request_runs_the_prompt_ids_its_router_forwards(tier_stack, model_name):
    """vLLM's decode-side token reuse (its test_kv_transfer_prompt_token_ids_round_trip): the ids in
    kv_transfer_params are the prompt, not the request's own messages, streamed or not."""
    client = _client(tier_stack)
    hello = [{"role": "user", "content": "Hello, how are you today?"}]
    baseline = await client.chat.completions.create(model=model_name, messages=hello, max_tokens=8, temperature=0,
                                                    extra_body={"return_token_ids": True})
    reused = baseline.model_extra["prompt_token_ids"]
    other = [{"role": "user", "content": "unrelated decode-side text"}]
    decode = await client.chat.completions.create(
        model=model_name, messages=other, max_tokens=8, temperature=0,
        extra_body={"kv_transfer_params": {"prompt_token_ids": reused}, "return_token_ids": True})
    assert decode.model_extra["prompt_token_ids"] == reused
    assert decode.choices[0].message.content == baseline.choices[0].message.content
    stream = await client.chat.completions.create(
        model=model_name, messages=other, max_tokens=8, temperature=0, stream=True,
        extra_body={"kv_transfer_params": {"prompt_token_ids": reused}, "return_token_ids": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == reused
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == baseline.choices[0].message.content
