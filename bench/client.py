"""The load generator: streaming OpenAI requests at a set concurrency or Poisson rate.

It runs on the machine it measures, so it is kept light: aiohttp (C-accelerated HTTP parsing, as
vLLM's `bench serve` uses) rather than httpx, which took twice the CPU per streamed token here
(2026-11-22), CPU that the server being measured then lacks.

Each request records what the client sees (TTFT, every inter-token gap, end to end, output
tokens) and, from Switchyard, the server-side timestamps in usage (the latency breakdown).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from bench.dataset import Prompt


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    started_at: float = 0.0  # Unix time when the request was started (the breakdown's way in)
    sent_at: float = 0.0  # Unix time when its headers were written to the socket (run_load's trace)
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    error: str = ""
    server: dict = field(default_factory=dict)  # Switchyard's timings block, when present

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0


@dataclass
class LoadSpec:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = True
    api_key: str = "unused"
    timeout_s: float = 600.0


def _body(spec: LoadSpec, prompt: Prompt) -> tuple[str, dict]:
    common = {"model": spec.model, "max_tokens": prompt.max_tokens, "stream": True, "temperature": 0,
              "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        common["ignore_eos"] = True  # vLLM and llama.cpp both read it
    if spec.endpoint == "chat":
        content = prompt.prompt if isinstance(prompt.prompt, str) else str(prompt.prompt)
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": content}]}
    return "/v1/completions", {**common, "prompt": prompt.prompt}


async def send(session: aiohttp.ClientSession, spec: LoadSpec, prompt: Prompt) -> RequestResult:
    path, body = _body(spec, prompt)
    started = time.perf_counter()
    result = RequestResult(ok=False, num_prompt_tokens=prompt.num_tokens, started_at=time.time())
    last = started
    num_chunks = 0
    try:
        async with session.post(spec.base_url + path, json=body, trace_request_ctx=result) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # SSE: "data: {...}" lines, blank lines between
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"].get("completion_tokens", 0)
                    result.server = chunk["usage"].get("timings") or {}
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                delta = choice.get("delta") or {}
                if not (choice.get("text") or delta.get("content") or delta.get("tool_calls")):
                    continue  # a chat stream's first chunk (the role) and last (the finish reason) carry no token
                num_chunks += 1
                if num_chunks == 1:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - started
        result.num_output_tokens = result.num_output_tokens or num_chunks
        result.ok = True
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _mark_sent(_session, trace_ctx, _params) -> None:
    if isinstance(trace_ctx.trace_request_ctx, RequestResult):
        trace_ctx.trace_request_ctx.sent_at = time.time()


async def run_load(spec: LoadSpec, prompts: list[Prompt], *, concurrency: int, request_rate: float = float("inf"),
                   seed: int = 0, progress: bool = True) -> tuple[list[RequestResult], float]:
    """All prompts at most `concurrency` at a time, arriving as a Poisson process of `request_rate`
    per second (inf: all at once). Returns the results and the wall time."""
    rng = random.Random(seed)
    # a fresh connection per request, for every server alike: llama.cpp's server closes kept-alive
    # connections after a few requests, and reusing one that it is closing fails the request
    connector = aiohttp.TCPConnector(limit=concurrency + 8, force_close=True)
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    gate = asyncio.Semaphore(concurrency)
    trace = aiohttp.TraceConfig()  # when each request's headers left: the client's own share of the way in
    trace.on_request_headers_sent.append(_mark_sent)
    bar = tqdm(total=len(prompts), desc=f"c={concurrency}", unit="req", disable=not progress, leave=False)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout,
                                     trace_configs=[trace]) as session:
        async def one(prompt: Prompt) -> RequestResult:
            async with gate:
                result = await send(session, spec, prompt)
            bar.update(1)
            return result

        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    bar.close()
    return list(results), wall
