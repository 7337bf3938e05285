"""OpenAI response shapes for completions and chat, whole and as stream chunks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float  # seconds from the request's arrival at the API to its first token
    tps: float  # completion tokens per second over the request's whole life
    timings: dict[str, float] | None = None  # the latency breakdown (see Generation.timings)

    def as_dict(self) -> dict:
        body = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "ttft": round(self.ttft, 6), "tps": round(self.tps, 3),
        }
        if self.timings:
            body["timings"] = {k: round(v, 6) for k, v in self.timings.items()}
        return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      stop_reason: str | int | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None,
                tool_calls: list[dict] | None = None, stop_reason: str | int | None = None,
                reasoning: str | None = None) -> dict:
    """reasoning: the thinking a reasoning parser took out, null without: vLLM's `reasoning`, and
    `reasoning_content` beside it (earlier vLLM's and DeepSeek's name, which clients still read)."""
    message = {"role": "assistant", "content": text, "reasoning": reasoning, "reasoning_content": reasoning}
    if tool_calls:
        message["content"] = text if text.strip() else None  # the blank line between thinking and a call is none
        message["tool_calls"] = tool_calls
    elif reasoning is not None and not text:
        message["content"] = None  # all thinking, no answer (cut by max_tokens): vLLM's null
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None, logprobs: list[dict] | None,
                      stop_reason: str | int | None = None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def response(request_id: str, created: int, model: str, is_chat: bool, choices: list[dict],
             usage: Usage | None) -> dict:
    """A whole response, with the keys vLLM always sends (null where it has nothing to say)."""
    body = {"id": request_id, "object": "chat.completion" if is_chat else "text_completion",
            "created": created, "model": model, "choices": choices, "service_tier": None,
            "system_fingerprint": None}
    if usage is not None:
        body["usage"] = usage.as_dict()
    return body


def chunk(request_id: str, created: int, model: str, is_chat: bool, choices: list[dict],
          usage: Usage | None = None) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage.as_dict()
    return body
