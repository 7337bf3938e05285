"""`python -m switchyard.batch` (vLLM's run-batch, in OpenAI's batch file format) against the stack:
every line answered once, in order, errors included."""

from __future__ import annotations

import json

import pytest

from switchyard import batch

pytestmark = pytest.mark.stack


def test_a_batch_file_gets_one_answer_per_line_in_order(stack, model_name, tmp_path, capsys):
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": model_name, "prompt": "Once upon", "max_tokens": 3, "stream": True}},
        {"custom_id": "response", "method": "POST", "url": "/v1/responses",
         "body": {"model": model_name, "input": "Hello", "max_output_tokens": 3}},
        {"custom_id": "refused", "method": "POST", "url": "/v1/completions",
         "body": {"model": model_name, "prompt": "x", "max_tokens": -1}},
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n{not json\n")
    out = tmp_path / "out.jsonl"
    assert batch.main(["-i", str(source), "-o", str(out), "--base-url", stack.base_url, "--concurrency", "2"]) == 0
    results = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert [r["custom_id"] for r in results] == ["chat", "completion", "response", "refused", "wrong-url", None]
    assert len({r["id"] for r in results}) == 6 and all(r["id"].startswith("batch_req_") for r in results)
    chat, completion, response, refused, wrong, bad = results
    assert chat["response"]["status_code"] == 200 and chat["response"]["body"]["object"] == "chat.completion"
    assert completion["response"]["body"]["object"] == "text_completion"  # stream is forced off
    assert response["response"]["body"]["object"] == "response"
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "max_tokens"
    assert wrong["error"]["code"] == "invalid_request" and bad["error"]["code"] == "invalid_json"
    assert "6 requests, 3 answered, 3 failed" in capsys.readouterr().err
