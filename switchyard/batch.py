"""`python -m switchyard.batch -i in.jsonl -o out.jsonl`: an OpenAI batch file through a running stack.

As vLLM's `run-batch`, in OpenAI's batch file format: each input line is
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/responses",
"body": {...}}`; each output line, in input order, is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. Every line is answered once: a line that cannot be sent (bad JSON,
another method or URL) gets an `error`, and one the server refuses gets its status and error body.
Unlike vLLM's, it runs no engine of its own: it sends the requests, `--concurrency` at a time, to a
Switchyard stack (`make run`'s by default), whose continuous batching does the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid

import httpx

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _error(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _parse(line: str, number: int) -> tuple[dict | None, dict | None]:
    """(request, None) or (None, its error line)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, _error(None, "invalid_json", f"line {number}: {exc}")
    if not isinstance(item, dict):
        return None, _error(None, "invalid_request", f"line {number}: not a JSON object")
    custom_id = item.get("custom_id")
    if item.get("method", "POST") != "POST" or item.get("url") not in URLS or not isinstance(item.get("body"), dict):
        return None, _error(custom_id, "invalid_request",
                            f"line {number}: needs method POST, a url of {', '.join(URLS)} and a body object")
    return item, None


async def _send(client: httpx.AsyncClient, item: dict) -> dict:
    body = {**item["body"], "stream": False}
    try:
        reply = await client.post(item["url"], json=body)
    except httpx.HTTPError as exc:
        return _error(item.get("custom_id"), "connection_error", f"{type(exc).__name__}: {exc}")
    try:
        answer = reply.json()
    except ValueError:
        answer = {"text": reply.text}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.get("custom_id"),
            "response": {"status_code": reply.status_code, "request_id": answer.get("id", ""), "body": answer},
            "error": None}


async def run(lines: list[str], base_url: str, api_key: str | None, concurrency: int,
              timeout_s: float = 600.0) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as client:

        async def one(number: int, line: str) -> dict:
            item, error = _parse(line, number)
            if error is not None:
                return error
            async with gate:
                return await _send(client, item)

        return await asyncio.gather(*(one(n, line) for n, line in enumerate(lines, start=1) if line.strip()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m switchyard.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL); - for standard input")
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL); - for standard output")
    p.add_argument("--base-url", default=os.environ.get("SWITCHYARD_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY"))
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    args = p.parse_args(argv)
    source = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    with source:
        lines = [line for line in source.read().split("\n") if line.strip()]  # not splitlines(): U+2028
    results = asyncio.run(run(lines, args.base_url.rstrip("/"), args.api_key, args.concurrency))
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    failed = sum(1 for r in results if r["error"] or r["response"]["status_code"] >= 400)
    print(f"{len(results)} requests, {len(results) - failed} answered, {failed} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
