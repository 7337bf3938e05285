"""Logprobs in OpenAI's two shapes: the completions API's parallel lists, and chat's token objects.

The sampled token always appears in a completion's top_logprobs, first (as vLLM lists it), so a
client can tell whether it was the most likely one (lm-evaluation-harness's is_greedy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.models.tokenizer import ModelTokenizer
from shared.wire.messages import Logprobs


@dataclass
class CompletionLogprobs:
    """Accumulates one choice's logprobs; `text_offset` counts characters of the choice's text."""

    tokenizer: ModelTokenizer
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>" for each token's text
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    num_chars: int = 0

    def add(self, token_ids: list[int] | tuple[int, ...], logprobs: list[Logprobs | None]) -> dict:
        """Appends these tokens; returns just their part (what a stream chunk carries)."""
        part = CompletionLogprobs(self.tokenizer, num_chars=self.num_chars)
        name = _token_id_name if self.as_token_ids else self.tokenizer.token_text
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = self.tokenizer.token_text(token_id)
            part.tokens.append(name(token_id))
            part.text_offset.append(part.num_chars)
            part.num_chars += len(text)
            if lp is None:
                part.token_logprobs.append(None)
                part.top_logprobs.append(None)
                continue
            part.token_logprobs.append(lp.logprob)
            top = {name(token_id): lp.logprob}  # the chosen token first, then the likeliest (vLLM's order)
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(name(i), v)
            part.top_logprobs.append(top)
        self.tokens += part.tokens
        self.token_logprobs += part.token_logprobs
        self.top_logprobs += part.top_logprobs
        self.text_offset += part.text_offset
        self.num_chars = part.num_chars
        return part.as_dict()

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def prompt_logprobs(tokenizer: ModelTokenizer, prompt_ids: list[int], logprobs: list[Logprobs | None],
                    as_token_ids: bool = False) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the most likely alternatives."""
    def name(token_id: int) -> str:
        return _token_id_name(token_id) if as_token_ids else tokenizer.token_text(token_id)

    out: list[dict | None] = []
    for token_id, lp in zip(prompt_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(i): {"logprob": v, "rank": r, "decoded_token": name(i)}
                 for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1)}
        entry[str(token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": name(token_id)}
        out.append(entry)
    return out


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_logprobs(tokenizer: ModelTokenizer, token_ids: list[int] | tuple[int, ...],
                  logprobs: list[Logprobs], as_token_ids: bool = False) -> list[dict]:
    """chat's `logprobs.content`: one object per token, with its bytes and its alternatives."""
    def entry(token_id: int, value: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        token = _token_id_name(token_id) if as_token_ids else raw.decode("utf-8", errors="replace")
        return {"token": token, "logprob": value, "bytes": list(raw)}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append(item)
    return content
