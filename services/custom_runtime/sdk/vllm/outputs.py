"""vLLM's RequestOutput and CompletionOutput: cumulative text and token ids, as vLLM yields them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: None = None
    metrics: dict = field(default_factory=dict)
