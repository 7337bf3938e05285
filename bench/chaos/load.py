"""The chaos run's steady load: a fixed set of requests of every kind a platform sees, their lone
runs (the oracle), and clients that send them through either gateway and record how each ended."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import openai

MODEL = "SmolLM2-135M-Instruct"
SHARED_PREFIX = ("You are a careful assistant for a railway company. Answer in plain words, keep to the facts, "
                 "and say when you do not know. The company runs freight and passenger trains across three "
                 "countries and its yards sort several thousand cars a day. ")
REFUSED_CODES = {"engine_unavailable", "unavailable", "queue_full", "bus_unavailable"}  # never accepted: retry
HUNG_AFTER_S = 240.0  # a request with no end by then is hung
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Spec:
    """One request of the mix. `exact`: greedy or seeded, so every run must equal its lone run."""

    name: str
    route: str  # "completions" | "chat"
    body: dict
    stream: bool
    exact: bool = True

    def payload(self) -> dict:
        return {**self.body, "stream": self.stream} | ({"stream_options": {"include_usage": True}} if self.stream else {})


def specs(adapters: list[str], max_tokens: int = 48) -> list[Spec]:
    """Greedy and seeded sampling, LoRA adapters, JSON-schema output, n > 1, logprobs, prompts that
    share a prefix, streamed and not; and unseeded sampling, which only has to end."""
    out = []
    topics = ["signals", "brakes", "timetables", "freight", "night trains", "bridges"]
    for i, topic in enumerate(topics):
        prompt = f"{SHARED_PREFIX}Question: what matters most about {topic}? Answer:"
        greedy = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        out.append(Spec(f"greedy-{topic}", "completions", greedy, stream=i % 2 == 0))
    seeded = {"model": MODEL, "prompt": "Once upon a time, on a branch line,", "max_tokens": max_tokens,
              "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True}
    out += [Spec("seeded", "completions", seeded, stream=True),
            Spec("seeded-n3", "completions", {**seeded, "n": 3, "seed": 11}, stream=False),
            Spec("logprobs", "completions", {"model": MODEL, "prompt": "The longest railway tunnel is",
                                             "max_tokens": max_tokens // 2, "temperature": 0, "logprobs": 2,
                                             "ignore_eos": True}, stream=True)]
    for j, adapter in enumerate(adapters):
        out.append(Spec(f"lora-{adapter}", "completions", {
            "model": adapter, "prompt": f"{SHARED_PREFIX}Write a SQL query that counts the wagons in yard {j}.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}, stream=j % 2 == 0))
    schema = {"type": "object", "properties": {"station": {"type": "string"}, "platforms": {"type": "integer"}},
              "required": ["station", "platforms"], "additionalProperties": False}
    out.append(Spec("json-schema", "chat", {
        "model": MODEL, "messages": [{"role": "user", "content": "Describe a small station as JSON."}],
        "max_tokens": max_tokens, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "station", "schema": schema}}},
        stream=False))
    out.append(Spec("chat-stream", "chat", {
        "model": MODEL, "messages": [{"role": "system", "content": SHARED_PREFIX},
                                     {"role": "user", "content": "Why do trains run on time?"}],
        "max_tokens": max_tokens, "temperature": 0}, stream=True))
    out.append(Spec("sampled", "completions", {"model": MODEL, "prompt": "A short poem about a yard:",
                                               "max_tokens": max_tokens, "temperature": 1.0}, stream=True, exact=False))
    return out


@dataclass
class Outcome:
    spec: str
    gateway: int
    started: float  # monotonic
    ended: float = 0.0
    status: str = ""  # whole | differed | error | refused | gateway_lost | hung | ended (inexact kinds)
    detail: str = ""
    chunk_times: list[float] = field(default_factory=list)
    accepted: bool = False  # a token (or an answer) came: the engine took it
    logprob_gap: float = 0.0  # the largest logprob difference from the lone run


@dataclass
class Answer:
    """What the client saw: each choice's text, finish reasons and (when asked) token logprobs."""

    texts: list[str]
    finish: list[str]
    logprobs: list[list[float]]

    def same(self, other: Answer) -> bool:
        """The same tokens, and their logprobs within LOGPROB_TOLERANCE (a request recomputed after
        a move computes its context as a prompt, whose attention sums in another order)."""
        return (self.texts, self.finish) == (other.texts, other.finish) and self.logprob_gap(other) <= LOGPROB_TOLERANCE

    def logprob_gap(self, other: Answer) -> float:
        if [len(x) for x in self.logprobs] != [len(x) for x in other.logprobs]:
            return float("inf")
        return max((abs(a - b) for xs, ys in zip(self.logprobs, other.logprobs, strict=True)
                    for a, b in zip(xs, ys, strict=True)), default=0.0)


async def send(http: httpx.AsyncClient, spec: Spec, outcome: Outcome) -> Answer:
    """One request, as an OpenAI client sends it; raises on an error status or an error event."""
    path = "/v1/completions" if spec.route == "completions" else "/v1/chat/completions"
    if not spec.stream:
        resp = await http.post(path, json=spec.payload())
        if resp.status_code != 200:
            raise StatusError(resp.status_code, resp.text)
        outcome.accepted = True
        return _answer(resp.json()["choices"], spec.route)
    choices: dict[int, dict] = {}
    async with http.stream("POST", path, json=spec.payload()) as resp:
        if resp.status_code != 200:
            raise StatusError(resp.status_code, (await resp.aread()).decode())
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise StatusError(event["error"].get("code") or 500, json.dumps(event["error"]))
            outcome.accepted = True
            outcome.chunk_times.append(time.monotonic())
            for c in event.get("choices") or []:
                merged = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None,
                                                         "lps": []})
                merged["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                merged["finish_reason"] = c.get("finish_reason") or merged["finish_reason"]
                merged["lps"] += (c.get("logprobs") or {}).get("token_logprobs") or []
    return Answer([c["text"] for _, c in sorted(choices.items())], [c["finish_reason"] for _, c in sorted(choices.items())],
                  [c["lps"] for _, c in sorted(choices.items())])


def _answer(choices: list[dict], route: str) -> Answer:
    choices = sorted(choices, key=lambda c: c["index"])
    texts = [c["text"] if route == "completions" else c["message"]["content"] for c in choices]
    lps = [((c.get("logprobs") or {}).get("token_logprobs") or []) for c in choices]
    return Answer(texts, [c["finish_reason"] for c in choices], lps)


class StatusError(Exception):
    def __init__(self, status: int | str, body: str):
        super().__init__(f"{status}: {body[:300]}")
        self.status = status
        self.body = body

    @property
    def code(self) -> str:
        try:
            return json.loads(self.body).get("error", {}).get("code") or str(self.status)
        except (ValueError, AttributeError):
            return str(self.status)


async def lone_runs(base_url: str, all_specs: list[Spec]) -> dict[str, Answer]:
    """Each exact request alone on the quiet stack: what every later run must give."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        return {s.name: await send(http, s, Outcome(s.name, 0, time.monotonic())) for s in all_specs if s.exact}


class Load:
    """`concurrency` clients, each sending requests of the mix through a random gateway until stopped."""

    def __init__(self, gateway_urls: list[str], all_specs: list[Spec], oracle: dict[str, Answer], seed: int,
                 concurrency: int):
        self.urls = gateway_urls
        self.specs = all_specs
        self.oracle = oracle
        self.rng = random.Random(seed)
        self.concurrency = concurrency
        self.outcomes: list[Outcome] = []
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        https = [httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(HUNG_AFTER_S, connect=5)) for u in self.urls]
        try:
            await asyncio.gather(*(self._client(https) for _ in range(self.concurrency)))
        finally:
            for http in https:
                await http.aclose()

    async def _client(self, https: list[httpx.AsyncClient]) -> None:
        while not self.stopping.is_set():
            spec, gateway = self.rng.choice(self.specs), self.rng.randrange(len(https))
            outcome = Outcome(spec.name, gateway, time.monotonic())
            self.outcomes.append(outcome)
            await self._one(https[gateway], spec, outcome)
            outcome.ended = time.monotonic()
            if outcome.status in ("refused", "gateway_lost"):
                await asyncio.sleep(0.5)  # as a client backs off before it retries

    async def _one(self, http: httpx.AsyncClient, spec: Spec, outcome: Outcome) -> None:
        try:
            async with asyncio.timeout(HUNG_AFTER_S):
                answer = await send(http, spec, outcome)
        except TimeoutError:
            outcome.status = "hung"
        except StatusError as exc:
            outcome.status = "refused" if exc.code in REFUSED_CODES or exc.status == 429 else "error"
            outcome.detail = str(exc)
        except (httpx.TransportError, openai.APIConnectionError) as exc:
            outcome.status = "gateway_lost"
            outcome.detail = f"{type(exc).__name__}: {exc}"
        else:
            if not spec.exact:
                outcome.status = "ended" if all(f in ("stop", "length") for f in answer.finish) else "differed"
            elif answer.same(self.oracle[spec.name]):
                outcome.status = "whole"
                outcome.logprob_gap = answer.logprob_gap(self.oracle[spec.name])
            else:
                outcome.status = "differed"
                outcome.detail = (f"{answer.texts} {answer.finish} vs {self.oracle[spec.name].texts} (logprobs "
                                  f"differ by {answer.logprob_gap(self.oracle[spec.name]):.2g})")
