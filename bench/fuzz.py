"""`python -m bench.fuzz`: hostile requests across every route; none may get a 5xx, hang or lose its connection.

    python -m bench.fuzz --base-url http://127.0.0.1:8000 --requests 5000 [--seed 2026]

Each case is a route's valid request with one to three values swapped for hostile ones (wrong
types, integers past 64 bits, non-ASCII digits, NATS wildcards and control characters in names,
deeply nested JSON, long strings), a raw body that is not JSON, a model upload with broken
metadata or a fake or truncated GGUF file, or a Files API upload with a bad purpose or content. Reported: requests, statuses, 5xx, hangs (no answer in
--timeout), connection errors, and whether the server still serves a real request afterwards.
A length field is never swapped for null: that asks for the whole context, a long answer rather
than hostile input. tests/test_hostile_input.py runs the same cases in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
from collections import Counter
from dataclasses import dataclass

import httpx

DEEP = 20_000  # nesting depth of the deep JSON values
HOSTILE = [
    None, "", "*", ">", "sy.v1.>", "a b", "a\nb", "x" * 100_000, 2**70, -(2**70), 2**63, 1e308, -1, 0, 1.5,
    "²", "١٢", "\u0663", True, [], {}, [1, "a", None], {"a": {"b": "c"}}, "__DEEP_LIST__", "__DEEP_DICT__",
    "../../etc/passwd", "\x00", "名前",
]
LENGTH_FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens")
LOGIT_BIAS_KEYS = ["²", "١٢", "𝟙", "99999999999999999999999", "-0", " 5", "5 ", "0x10", "1e3"]
GGUF_MAGIC = b"GGUF"


@dataclass
class Case:
    method: str
    path: str
    body: bytes | None = None
    files: dict | None = None
    data: dict | None = None


def _bases(model: str) -> list[tuple[str, str, dict | None]]:
    chat = [{"role": "user", "content": "Hi"}]
    return [
        ("POST", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 2}),
        ("POST", "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2}),
        ("POST", "/tokenize", {"model": model, "prompt": "Hi"}),
        ("POST", "/detokenize", {"model": model, "tokens": [1, 2]}),
        ("POST", "/invocations", {"model": model, "prompt": "Hi", "max_tokens": 2}),
        ("POST", "/v1/api/models/list", {}),
        ("POST", "/v1/api/models/get", {"name": "fuzz-model"}),
        ("POST", "/v1/api/models/versions", {"name": "fuzz-model"}),
        ("POST", "/v1/api/models/configure", {"name": "fuzz-model", "continuous_batching_config": {}}),
        ("POST", "/v1/api/pipelines/create", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/add_step", {"name": "fuzz-pipe", "model": "fuzz-model"}),
        ("POST", "/v1/api/pipelines/clear_steps", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/deploy", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/undeploy", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/list", {}),
        ("POST", "/v1/api/pipelines/get", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/status", {"name": "fuzz-pipe"}),
        ("POST", "/v1/api/pipelines/infer/fuzz-dep/fuzz-pipe", {"prompt": "Hi"}),
        ("POST", "/v1/api/pipelines/infer/fuzz-dep/fuzz-pipe/openai/v1/completions", {"prompt": "Hi"}),
        ("POST", "/v1/batches", {"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/chat/completions",
                                 "completion_window": "24h", "metadata": {"k": "v"}}),
        ("GET", "/v1/responses/{id}", None), ("POST", "/v1/responses/{id}/cancel", None),
        ("GET", "/v1/batches/{id}", None), ("POST", "/v1/batches/{id}/cancel", None),
        ("GET", "/v1/batches?limit=2&after={id}", None), ("GET", "/v1/files/{id}", None),
        ("GET", "/v1/files/{id}/content", None), ("DELETE", "/v1/files/{id}", None),
        ("GET", "/tokenizer_info?model={id}", None),
        ("GET", "/v1/models", None), ("GET", "/health", None), ("GET", "/version", None), ("GET", "/load", None),
    ]


def _encode(body: dict) -> bytes:
    text = json.dumps(body)
    text = text.replace('"__DEEP_LIST__"', "[" * DEEP + "]" * DEEP)
    return text.replace('"__DEEP_DICT__"', '{"a":' * DEEP + "1" + "}" * DEEP).encode()


def _corrupt(rng: random.Random, body: dict) -> dict:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.15:
            body["logit_bias"] = {rng.choice(LOGIT_BIAS_KEYS): rng.choice([1, 500, "x"])}
        elif roll < 0.3:
            body[rng.choice(["top_k", "min_tokens", "n", "seed", "max_tokens", "logprobs", "top_logprobs"])] = \
                rng.choice([2**64, 2**70, -(2**70), 10**30])
        elif roll < 0.4:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": "__DEEP_DICT__"}}
        elif roll < 0.5 or not body:
            body[rng.choice(["extra", "stop", "messages", "prompt", "name", "version", "user"])] = rng.choice(HOSTILE)
        else:
            key = rng.choice(list(body))
            body[key] = rng.choice(HOSTILE[1:] if key in LENGTH_FIELDS else HOSTILE)
    return body


def _upload(rng: random.Random) -> Case:
    meta = {"name": rng.choice(["fuzz-model", "bad name", "a*", "x>", "ok\n", "名前"]),
            "conversion": {"framework": "vllm", "accel": "cpu"}}
    deep = dict(meta, conversion={"framework": "vllm", "accel": rng.choice(["cpu", rng.choice(HOSTILE[:20])]),
                                  "framework_config": rng.choice([rng.choice(HOSTILE[:20]), {
                                      "framework": "vllm", "config": rng.choice([rng.choice(HOSTILE[:20]), {
                                          rng.choice(["max_model_len", "dtype", "block_size", "quantization"]):
                                          rng.choice(HOSTILE[:20])}])}])},
                **{rng.choice(["visibility", "workspace_id", "input_schema", "output_schema"]): rng.choice(HOSTILE[:20])})
    metadata = rng.choice([json.dumps(meta), "{not json", "[]", "42", json.dumps({"name": "fuzz-model",
                           "conversion": rng.choice(HOSTILE[:20])}), _encode({"name": "__DEEP_DICT__"}).decode(),
                           json.dumps(deep), json.dumps(deep)])
    header = GGUF_MAGIC + struct.pack("<IQQ", 3, 10, 5)  # a GGUF header promising tensors and fields it lacks
    payload = rng.choice([b"", b"not a model", GGUF_MAGIC, header, header + b"\x00" * 7, header + bytes(range(256)),
                          b"PK\x03\x04" + b"\x00" * 30])
    return Case("POST", "/v1/api/models/upload_and_convert", files={"file": ("model.gguf", payload)},
                data={"metadata": metadata})


def _file(rng: random.Random) -> Case:
    payload = rng.choice([b"", b"{not json\n", b'{"custom_id": "a"}\n' * 3, bytes(range(256)), b"\n" * 1000])
    return Case("POST", "/v1/files", files={"file": ("in.jsonl", payload)},
                data={"purpose": rng.choice(["batch", "", "fine-tune", "x" * 5000, "\x00"])})


def cases(rng: random.Random, model: str, count: int) -> list[Case]:
    bases, out = _bases(model), []
    raw = [b"{not json", b"", b"[]", b"42", b'"text"', b"null", b'{"model": "\xff\xfe"}', b"{" * 5000,
           b'{"model": 1e999}', ("[" * DEEP).encode()]
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            out.append(_upload(rng))
            continue
        if roll < 0.07:
            out.append(_file(rng))
            continue
        method, path, body = rng.choice(bases)
        if "{id}" in path:
            out.append(Case(method, path.replace("{id}", rng.choice(["*", ">", "a b", "resp_x", "..", "%00", "名"]))))
        elif body is None:
            out.append(Case(method, path))
        elif roll < 0.12:
            out.append(Case(method, path, rng.choice(raw)))
        else:
            out.append(Case(method, path, _encode(_corrupt(rng, body))))
    return out


async def send(client: httpx.AsyncClient, case: Case) -> tuple[int | str, Case]:
    try:
        if case.files is not None:
            r = await client.post(case.path, files=case.files, data=case.data)
        elif case.body is not None:
            r = await client.request(case.method, case.path, content=case.body,
                                     headers={"content-type": "application/json"})
        else:
            r = await client.request(case.method, case.path)
        return r.status_code, case
    except httpx.TimeoutException:
        return "hang", case
    except httpx.TransportError as exc:
        return f"connection error ({type(exc).__name__})", case


async def run(base_url: str, model: str, count: int, seed: int, timeout: float, concurrency: int = 16) -> dict:
    todo = cases(random.Random(seed), model, count)
    outcomes: Counter = Counter()
    bad: list[tuple[int | str, Case]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        for start in range(0, len(todo), concurrency):
            for status, case in await asyncio.gather(*(send(client, c) for c in todo[start : start + concurrency])):
                outcomes[status] += 1
                if not isinstance(status, int) or status >= 500:
                    bad.append((status, case))
        alive = await client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3})
        versions = (await client.post("/v1/api/models/versions", json={"name": "fuzz-model"})).json()["versions"]
    stuck = [v["version"] for v in versions if v["status"] == "uploading"]
    return {"requests": len(todo), "outcomes": outcomes, "bad": bad, "alive": alive.status_code == 200,
            "stuck_uploads": stuck}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    result = asyncio.run(run(args.base_url, args.model, args.requests, args.seed, args.timeout))
    statuses = sorted(result["outcomes"].items(), key=lambda kv: str(kv[0]))
    print(f"requests: {result['requests']}; outcomes: {statuses}; still serving: {result['alive']}; "
          f"uploads left in 'uploading': {len(result['stuck_uploads'])}")
    for status, case in result["bad"][:20]:
        print(f"  {status}: {case.method} {case.path} {(case.body or b'')[:160]!r} {str(case.data)[:160]}")
    raise SystemExit(0 if not result["bad"] and result["alive"] and not result["stuck_uploads"] else 1)


if __name__ == "__main__":
    main()
