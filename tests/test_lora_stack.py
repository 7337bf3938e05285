"""LoRA adapters through the whole stack on `make run`'s defaults, with the official openai client:
served from start (--lora-modules) and loaded at run time (vLLM's routes), listed by /v1/models
with their parent,
each answering as transformers with PEFT's merged weights, in one mixed batch; unloaded while a
request runs on it; what is refused and with which status. Random adapters saved by peft for the
real SmolLM2's shapes."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from switchyard.launcher import Service
from switchyard.nats_server import free_port
from tests.conftest import _start_stack

pytestmark = pytest.mark.stack
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"sql": (8, ALL, False), "chat-qv": (16, ["q_proj", "v_proj"], True), "late": (4, ["o_proj", "down_proj"], False)}
PROMPT = "The capital of France is"
NUM_TOKENS = 12


def _save(hf_model, folder, rank: int, targets: list[str], rslora: bool, seed: int) -> None:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=rank * 2, use_rslora=rslora, target_modules=targets,
                             init_lora_weights=False, lora_dropout=0.0)
    peft.get_peft_model(copy.deepcopy(hf_model), config).save_pretrained(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("smollm2-loras")
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        _save(hf_model, root / name, rank, targets, rslora, seed)
    _save(hf_model, root / "too-big", 32, ["q_proj"], False, 9)
    return {name: str(root / name) for name in [*ADAPTERS, "too-big"]}


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, adapters):
    """On `make run`'s defaults (the suite's other stacks run --deterministic): the C kernels, the
    GGUF's Q8_0 blocks kept, the adapters' deltas from the C grouped LoRA GEMM."""
    stack = _start_stack(tmp_path_factory, "lora", 1, [
        "--no-deterministic", "--lora-modules", f"sql={adapters['sql']}", f"chat-qv={adapters['chat-qv']}",
        "--max-loras", "2"])
    yield stack
    stack.stop()


def merged_text(hf_model, hf_tokenizer, adapter: str | None) -> str:
    """PROMPT's greedy continuation by transformers with the adapter's weights merged in by PEFT."""
    ids = torch.tensor([hf_tokenizer.encode(PROMPT)])
    model = copy.deepcopy(hf_model)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.inference_mode():
        tokens = model.generate(ids, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
    return hf_tokenizer.decode(tokens[0, ids.shape[1]:])


@pytest.fixture(scope="module")
def expected(hf_model, hf_tokenizer, adapters) -> dict[str, str]:
    """Each adapter's greedy text from transformers with PEFT's merged weights (and the base's)."""
    out = {name or "base": merged_text(hf_model, hf_tokenizer, adapters.get(name)) for name in [None, *ADAPTERS]}
    assert len(set(out.values())) == len(out)  # every adapter answers its own way
    return out


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _complete(client, model: str) -> str:
    answer = await client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert answer.model == model
    return answer.choices[0].text


async def test_models_lists_each_adapter_with_its_parent(lora_stack, model_name, adapters):
    async with _client(lora_stack) as client:
        models = {m.id: m for m in (await client.models.list()).data}
    assert models["sql"].parent == model_name and models["sql"].root == adapters["sql"]
    assert models["chat-qv"].parent == model_name and models[model_name].parent is None


async def test_adapters_and_the_base_in_one_batch_answer_as_their_merged_models(lora_stack, model_name, expected):
    """Base, sql and chat-qv, twice each, all in flight at once (max_loras 2: the scheduler mixes
    both adapters and the base in a step)."""
    names = [model_name, "sql", "chat-qv"] * 2
    async with _client(lora_stack) as client:
        answers = await asyncio.gather(*(_complete(client, name) for name in names))
    for name, text in zip(names, answers, strict=True):
        assert text == expected["base" if name == model_name else name], name
    async with httpx.AsyncClient(base_url=lora_stack.base_url) as http:  # vLLM's LoRA gauge, idle now
        metrics = (await http.get("/metrics")).text
    assert f'vllm:lora_requests_info{{max_lora="2",model_name="{model_name}",running_lora_adapters="",' \
           'waiting_lora_adapters=""}' in metrics


async def test_an_adapter_loaded_at_run_time_serves_and_unloads_after_its_running_request(lora_stack, adapters,
                                                                                         expected):
    base = lora_stack.base_url
    async with httpx.AsyncClient(base_url=base, timeout=120) as http, _client(lora_stack) as client:
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
        assert "late" in {m.id for m in (await client.models.list()).data}
        assert await _complete(client, "late") == expected["late"]
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        stream = await client.completions.create(model="late", prompt=PROMPT, max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        chunks = [await anext(stream)]
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'late' removed successfully."
        with pytest.raises(openai.NotFoundError):  # new requests are refused at once
            await _complete(client, "late")
        chunks += [chunk async for chunk in stream]  # the running one finishes on the adapter
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length" and text.startswith(expected["late"])
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert "late" not in {m.id for m in (await client.models.list()).data}


async def test_an_adapter_loaded_again_in_place_is_never_served_from_its_old_weights_cached_blocks(
        lora_stack, adapters):
    """`load_inplace` gives a name other weights: the prefix cache must not hand its requests the KV
    computed with the old ones (the adapter's digest is in block 0's hash). A 40-token prompt spans
    two full blocks, so its second request would hit them."""
    prompt = "In a railway yard, cars are sorted onto tracks by destination. " * 4

    async def complete(client, model: str) -> str:
        answer = await client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert answer.usage.prompt_tokens >= 40
        return answer.choices[0].text

    async with httpx.AsyncClient(base_url=lora_stack.base_url, timeout=120) as http, _client(lora_stack) as client:
        as_sql = await http.post("/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": adapters["sql"]})
        assert as_sql.status_code == 200
        first = await complete(client, "swap")
        assert first == await complete(client, "sql")  # the same weights under two names
        as_chat = await http.post("/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": adapters["chat-qv"],
                                                                 "load_inplace": True})
        assert as_chat.status_code == 200
        assert await complete(client, "swap") == await complete(client, "chat-qv") != first
        await http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})


async def test_bad_adapters_and_names_are_refused_with_their_status(lora_stack, adapters, tmp_path):
    async with httpx.AsyncClient(base_url=lora_stack.base_url, timeout=120) as http, _client(lora_stack) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await _complete(client, "nobody")
        assert missing.value.body["code"] == "model_not_found"
        big = await http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": adapters["too-big"]})
        assert big.status_code == 400 and "rank 32 is over --max-lora-rank 16" in big.json()["error"]["message"]
        nowhere = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert nowhere.status_code == 400 and "no adapter_config.json" in nowhere.json()["error"]["message"]
        unknown = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path),
                                                                  "lora_int_id": 3})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_int_id"
        assert "big" not in {m.id for m in (await client.models.list()).data}


async def _until_live(url: str, gateway: Service, timeout: float = 60.0) -> None:
    """Poll the new gateway's /live until it answers (it asks nothing of the stopped scheduler)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=2) as http:
        while gateway.is_running and time.monotonic() < deadline:
            try:
                if (await http.get("/live")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await asyncio.sleep(0.2)
    raise AssertionError(f"the gateway did not answer /live (exit status {gateway.proc.poll()})")


async def test_a_gateway_started_while_its_scheduler_is_silent_asks_again_for_an_adapter(lora_stack, expected,
                                                                                        tmp_path):
    """A gateway learns a model's adapters from its scheduler. Started while the scheduler does not
    answer (stopped), it does not know `sql`: 503 engine_unavailable with Retry-After, not a 404;
    once the scheduler answers, the same gateway serves it (the chaos schedule's restarted gateway)."""
    port, scheduler = free_port(), lora_stack.service("scheduler").proc
    gateway = Service("api-late", [sys.executable, "-m", "services.api", "--nats-url", lora_stack.nats_url,
                                   *lora_stack.service_args, "--port", str(port)], log_file=tmp_path / "api-late.log")
    url = f"http://127.0.0.1:{port}"
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        try:
            gateway.start(lora_stack._env("api"))
            await _until_live(url, gateway)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                refused = await http.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 1})
        finally:
            os.kill(scheduler.pid, signal.SIGCONT)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable" and refused.headers["retry-after"] == "1"
        lora_stack.wait_ready(timeout=120)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            assert await _complete(client, "sql") == expected["sql"]
    finally:
        if gateway.proc is not None:
            gateway.proc.terminate()
            try:
                gateway.proc.wait(30)
            except subprocess.TimeoutExpired:
                gateway.proc.kill()
