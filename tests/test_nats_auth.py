"""A locked bus: each service's user may touch only its subjects; an Abort needs the submitter's key."""

from __future__ import annotations

import asyncio

import nats
import pytest

from shared.bus import nats_auth
from shared.bus.client import BusClient
from shared.wire import subjects
from shared.wire.messages import TOKEN_BATCH_DECODER, Abort, FinishReason, SamplingParams, encode
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def locked():
    server = NatsServer(auth=True).start()
    yield server
    server.stop()


async def _connect_as(server: NatsServer, user: str):
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(nats_auth.url_with_login(server.url, user, server.auth_dir), error_cb=on_error,
                            allow_reconnect=False)
    return nc, errors


async def test_no_login_no_bus(locked):
    with pytest.raises(Exception, match="[Aa]uthorization"):
        await nats.connect(locked.url, allow_reconnect=False, max_reconnect_attempts=0)


@pytest.mark.parametrize(("user", "action", "subject"), [
    ("client", "pub", "$KV.sy-registry.models.x.1"),  # an internal client cannot rewrite the registry
    ("client", "sub", "sy.v1.m.submit"),  # nor read every prompt
    ("worker", "sub", "sy.v1.m.submit"),
    ("api", "sub", "sy.v1.worker.w1.step"),
    ("kvcache", "pub", "sy.v1.out.someone"),  # nor write into another's token stream
    ("client", "pub", "sy.v1.tokens.m"),
])
async def test_a_user_is_refused_what_its_service_does_not_need(locked, user, action, subject):
    nc, errors = await _connect_as(locked, user)
    if action == "pub":
        await nc.publish(subject, b"x")
    else:
        await nc.subscribe(subject)
    await nc.flush()
    async with asyncio.timeout(5):  # the server's -ERR reaches the error callback soon after
        while not errors:
            await asyncio.sleep(0.01)
    await nc.close()
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_a_user_may_do_what_its_service_needs(locked):
    nc, errors = await _connect_as(locked, "client")
    await nc.subscribe("sy.v1.out.me")
    await nc.publish("sy.v1.m.submit", b"x")
    await nc.flush()
    refused, later_errors = await _connect_as(locked, "client")  # a refusal on the same server: the yardstick
    await refused.subscribe("sy.v1.m.submit")
    await refused.flush()
    async with asyncio.timeout(5):  # once the later refusal has come back, an earlier one would have
        while not later_errors:
            await asyncio.sleep(0.01)
    await refused.close()
    await nc.close()
    assert errors == []


async def test_an_abort_without_the_submitters_key_is_refused_and_the_owners_gets_a_final_entry(stack, model_name):
    nc = await nats.connect(stack.admin_url)
    owner, other = BusClient(nc), BusClient(nc)
    await owner.start()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    stream = await owner.submit(model_name, [400 + i for i in range(12)], params)
    entries = stream.entries(timeout=60)
    await entries.__anext__()
    await other.abort(model_name, [stream.request_id])  # another client's key: refused
    rest = [e async for e in entries]
    assert rest[-1].finish_reason == FinishReason.LENGTH and stream.num_tokens == 24

    finals = asyncio.Queue()

    async def watch(msg):
        for entry in TOKEN_BATCH_DECODER.decode(msg.data).entries:
            if entry.finish_reason is not None:
                finals.put_nowait(entry)

    second = await owner.submit(model_name, [500 + i for i in range(12)], SamplingParams(
        max_tokens=4000, temperature=0.0, ignore_eos=True))
    watcher = await nc.subscribe(owner.reply_subject, cb=watch)
    await second.entries(timeout=60).__anext__()
    await nc.publish(subjects.abort(model_name), encode(Abort([second.request_id], abort_key=owner.abort_key)))
    final = await asyncio.wait_for(finals.get(), 30)
    assert final.request_id == second.request_id and final.finish_reason == FinishReason.ABORT
    await watcher.unsubscribe()
    await owner.stop()
    await nc.close()


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B", "my model*>"])
async def test_a_model_name_with_dots_or_wildcards_is_one_token_the_permissions_allow(locked, model):
    """Hub names carry dots (Qwen2.5, Llama-3.1): each name is one subject token, so the gateway's
    submit reaches the scheduler through its per-token permissions, and no name reaches another's."""
    scheduler, scheduler_errors = await _connect_as(locked, "scheduler")
    api, api_errors = await _connect_as(locked, "api")
    mine, other = await scheduler.subscribe(subjects.submit(model)), await scheduler.subscribe(subjects.submit("x"))
    await scheduler.flush()
    # nats-server 2.9.10 (Debian's) misses about 1 in 1,000-4,000 messages published within
    # milliseconds of their subscription (docs/architecture.md, "A locked bus"), without an error
    # either side: a second copy is sent if the first has not come. A refusal would be an error.
    for attempt in range(3):
        await api.publish(subjects.submit(model), b"hello")
        await api.flush()
        try:
            assert (await mine.next_msg(timeout=5)).data == b"hello"
            break
        except nats.errors.TimeoutError:
            assert attempt < 2 and scheduler_errors == api_errors == [], (scheduler_errors, api_errors)
    with pytest.raises(nats.errors.TimeoutError):
        await other.next_msg(timeout=0.2)
    await scheduler.close()
    await api.close()
    assert scheduler_errors == api_errors == []


def test_distinct_names_stay_distinct_tokens():
    names = ["Qwen2.5", "Qwen2%2E5", "Qwen2_5", "a b", "a%20b", "a/b", "a.b.c"]
    tokens = [subjects.token(n) for n in names]
    assert len(set(tokens)) == len(names)
    assert all("." not in t and " " not in t and "*" not in t and ">" not in t for t in tokens)
    assert subjects.token("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_users_command_takes_help_and_refuses_a_flag_for_a_folder(tmp_path):
    """`--help` once made a folder named `--help` and wrote the bus's passwords into it."""
    import subprocess
    import sys

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shared.bus.nats_auth", *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    shown = run("--help")
    assert shown.returncode == 0 and "usage: python -m shared.bus.nats_auth" in shown.stdout
    refused = run("--users")
    assert refused.returncode == 2 and "error" in refused.stderr
    assert list(tmp_path.iterdir()) == []
    made = run("auth")
    assert made.returncode == 0 and (tmp_path / "auth" / "nats-users.json").exists()
