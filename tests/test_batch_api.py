"""OpenAI's Files and Batch APIs through the openai SDK against the real stack: every line answered
once, in input order, bad lines in the error file, invalid input files failing the batch, cancel."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

pytestmark = pytest.mark.stack
TERMINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[dict]) -> io.BytesIO:
    data = io.BytesIO("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode())
    data.name = "requests.jsonl"
    return data


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def wait_until(client: openai.OpenAI, batch_id: str, statuses=TERMINAL, timeout: float = 240.0):
    """The batch's status, polled as a client must (the API has no push), until it is one of these."""
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n") if line]


def test_a_batch_answers_every_line_once_in_order(openai_client, model_name):
    # U+2028 is valid unescaped in a JSON string: the line must not be cut there
    questions = ["What is 2+2?", "Name a color.", "Say hi.\u2028Now.", "What is the capital of France?", "Count to 3."]
    lines = [chat_line(f"q-{i}", q, model=model_name, max_tokens=8, temperature=0) for i, q in enumerate(questions)]
    lines.insert(2, chat_line("too-hot", "Hello", model=model_name, temperature=5))  # the route refuses it
    uploaded = openai_client.files.create(file=jsonl(lines), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0 and uploaded.filename == "requests.jsonl"
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"team": "search"})
    assert batch.status == "validating" and batch.metadata == {"team": "search"}
    batch = wait_until(openai_client, batch.id)
    assert batch.status == "completed" and batch.completed_at >= batch.in_progress_at >= batch.created_at
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    output = read_lines(openai_client, batch.output_file_id)
    assert [o["custom_id"] for o in output] == [f"q-{i}" for i in range(5)]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    direct = openai_client.chat.completions.create(model=model_name, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": questions[3]}])
    body = output[3]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert body["id"] == output[3]["response"]["request_id"]
    errors = read_lines(openai_client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["too-hot"] and errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "temperature"
    assert batch.id in [b.id for b in openai_client.batches.list(limit=100)]
    assert openai_client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert openai_client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(uploaded.id)


def test_an_invalid_input_file_fails_the_batch_and_bad_requests_are_refused(openai_client, model_name):
    lines = [chat_line("a", "Hi", model=model_name, max_tokens=2), chat_line("a", "Hi again", model=model_name),
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": model_name}}]
    uploaded = openai_client.files.create(file=jsonl(lines), purpose="batch")
    batch = wait_until(openai_client, openai_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3)]
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="1h")
    with pytest.raises(openai.NotFoundError, match="file-"):
        openai_client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        openai_client.files.create(file=jsonl(lines), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.retrieve("batch_" + "0" * 32)


def test_a_cancelled_batch_stops_and_keeps_what_it_answered(openai_client, model_name):
    lines = [chat_line(f"long-{i}", f"Tell a long story number {i}.", model=model_name, max_tokens=200,
                       ignore_eos=True) for i in range(64)]
    uploaded = openai_client.files.create(file=jsonl(lines), purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    wait_until(openai_client, batch.id, ("in_progress",))
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_until(openai_client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    answered = read_lines(openai_client, batch.output_file_id)
    assert batch.request_counts.completed == len(answered) < 64
    assert len({a["custom_id"] for a in answered}) == len(answered)
    with pytest.raises(openai.ConflictError):
        openai_client.batches.cancel(
            wait_until(openai_client, openai_client.batches.create(
                input_file_id=openai_client.files.create(file=jsonl(lines[:1]), purpose="batch").id,
                endpoint="/v1/chat/completions", completion_window="24h").id).id)
    # vLLM's priority field (the batch's lines run at 1): any 32-bit value, refused past it
    reply = openai_client.chat.completions.create(model=model_name, max_tokens=2,
                                                  messages=[{"role": "user", "content": "Hi"}],
                                                  extra_body={"priority": -5})
    assert reply.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="priority"):
        openai_client.chat.completions.create(model=model_name, max_tokens=2, extra_body={"priority": 2**40},
                                              messages=[{"role": "user", "content": "Hi"}])
