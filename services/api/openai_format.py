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

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "ttft": round(self.ttft, 6), "tps": round(self.tps, 3),
        }


def completion(request_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage.as_dict()}


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_completion(request_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage.as_dict()}


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage: Usage) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage.as_dict()}
