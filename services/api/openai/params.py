"""From an OpenAI request to what the engine takes: prompt token ids and SamplingParams.

Every check that depends on the model (vocabulary, context length, logprob cap, schema) is
here, so a request the engine receives is one it can run.
"""

from __future__ import annotations

import re

from services.api.context import ServedModel
from services.api.errors import APIError
from services.api.media.prompt import PromptImage, expand_placeholders
from services.api.openai.chat_template import ChatTemplateError, render_chat
from services.api.openai.protocol import (
    MAX_N,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Tool,
    _Sampling,
)
from services.api.openai.structured import guided
from services.api.openai.tools.prompt import template_messages, template_tools, tool_template, uses_tools
from shared.config import context_length_error
from shared.wire.messages import SamplingParams

_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")  # ASCII digits: isdigit() and int() take other scripts too
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's values range over [-100, 100]
_SEED_MIX = 0x9E3779B97F4A7C15


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed; the others get their own, fixed by it."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_MIX) & 0x7FFF_FFFF_FFFF_FFFF


def encode_text(model: ServedModel, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Refuses, before tokenizing it, a text too long for the model's context whatever its tokens
    (each token covers at most max_token_bytes bytes, and a character at least one byte)."""
    at_least = len(text) // model.tokenizer.max_token_bytes
    if model.max_model_len and at_least > model.max_model_len:
        raise APIError(400, f"{param} is {len(text)} characters: at least {at_least} tokens, more than the model's "
                            f"context of {model.max_model_len} tokens", param=param, code="context_length_exceeded")
    try:
        return model.tokenizer.encode(text, add_special_tokens)
    except Exception as exc:  # e.g. lone surrogates the tokenizer cannot take
        raise APIError(400, f"{param} cannot be tokenized: {exc}", param=param) from None


TEMPLATE_OWN_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def render_messages(model: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[Tool] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict | None = None, images: list[PromptImage] | None = None) -> str:
    """Chat messages through the model's chat template (its own, or the OpenAI config's override);
    with tools, or tool calls and results in the history, a template that can render them.
    continue_final_message (vLLM's): the last message is left open, so the model continues it.
    images: the image parts as stored (media/prompt.py), whose runs of image tokens replace their placeholders."""
    if continue_final_message:
        if add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        if messages[-1].role != "assistant" or not messages[-1].text():
            raise APIError(400, "continue_final_message needs a final assistant message with text to continue",
                           param="continue_final_message")
    check_generates(model)
    if not model.chat_template:
        raise APIError(400, f"model {model.name!r} has no chat template", param="messages")
    taken = [k for k in template_kwargs or {} if k in TEMPLATE_OWN_NAMES]
    if taken:
        raise APIError(400, f"chat_template_kwargs cannot set {taken[0]!r}: the request's own fields set it",
                       param="chat_template_kwargs")
    template, extra = model.chat_template, dict(template_kwargs or {})  # e.g. enable_thinking, for the template
    if uses_tools(messages, tools):
        template, extra = tool_template(model.chat_template), {**extra, "tools": template_tools(tools)}
    try:
        text = render_chat(template, template_messages(messages), bos_token=model.tokenizer.bos_token,
                           eos_token=model.tokenizer.eos_token, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if model.images is not None:
        text = expand_placeholders(text, model, images or [])
    if continue_final_message:  # cut what the template closes the last message with (as transformers does)
        final = messages[-1].text()
        text = text[: text.rindex(final) + len(final)] if final in text else text
    return text


def completion_prompts(body: CompletionRequest, model: ServedModel) -> list[list[int]]:
    """One token-id list per prompt: a text, a list of texts, token ids, or a list of those."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [encode_text(model, prompt, "prompt")]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [encode_text(model, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]
    prompts = [truncated(ids, body, model) for ids in prompts]
    if not prompts or any(not ids for ids in prompts):
        raise APIError(400, "The decoder prompt cannot be empty", param="prompt")  # vLLM's words
    if len(prompts) * body.n > 2 * MAX_N:
        raise APIError(400, f"{len(prompts)} prompts x n={body.n} is more than {2 * MAX_N} choices", param="n")
    for ids in prompts:
        check_token_ids(ids, model, "prompt")
    return prompts


def truncated(ids: list[int], body: _Sampling, model: ServedModel) -> list[int]:
    """vLLM's truncate_prompt_tokens: k tokens kept (-1: the context less one, for an answer), the
    first k (truncation_side "right", the tokenizers' default) or the last k ("left")."""
    k = body.truncate_prompt_tokens
    if k is None:
        if body.truncation_side is not None:
            raise APIError(400, "truncation_side needs truncate_prompt_tokens", param="truncation_side")
        return ids
    if k == -1:
        k = max(model.max_model_len - 1, 0)
    if k >= len(ids):
        return ids
    return ids[len(ids) - k:] if body.truncation_side == "left" else ids[:k]


def check_token_ids(ids: list[int], model: ServedModel, param: str) -> None:
    bad = next((t for t in ids if t < 0 or t >= model.tokenizer.vocab_size), None)
    if bad is not None:  # vLLM's words first: clients match on them
        raise APIError(400, f"Token id {bad} is out of vocabulary (ids are 0 to {model.tokenizer.vocab_size - 1})",
                       param=param)


def check_ready(model: ServedModel) -> None:
    """503 while no worker serves the model: its limits come from its workers (the scheduler says 503 too)."""
    if not model.max_model_len:
        raise APIError(503, f"no worker is ready for model {model.name!r}", code="unavailable")


def check_generates(model: ServedModel) -> None:
    """An encoder (BERT) embeds and scores: a generation route answers 400, as vLLM's do."""
    if model.embedding is not None and model.embedding.encoder:
        raise APIError(400, f"The model {model.name!r} does not support generation: it is an encoder "
                            f"({', '.join(model.architectures)}) that serves /v1/embeddings, /score and /rerank",
                       param="model")


def sampling_params(body: _Sampling, model: ServedModel, num_prompt: int, *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    check_ready(model)
    check_generates(model)
    if max_tokens is None:
        max_tokens = model.max_model_len - num_prompt  # chat without max_tokens: the room left
    too_long = context_length_error(model.max_model_len, num_prompt, max_tokens)
    if too_long:
        raise APIError(400, too_long, param="max_tokens", code="context_length_exceeded")
    if max_tokens < 1:
        raise APIError(400, f"the prompt ({num_prompt} tokens) leaves no room in the model's context "
                            f"of {model.max_model_len} tokens", param="messages")
    limit = model.tokenizer.vocab_size if model.max_logprobs == -1 else model.max_logprobs  # vLLM's -1: no limit
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > limit:
            raise APIError(400, f"Requested {name} of {value}, which is greater than max allowed: {limit} "
                                "(--max-logprobs)", param=name)
    check_token_ids(body.stop_token_ids or [], model, "stop_token_ids")
    check_token_ids(body.allowed_token_ids or [], model, "allowed_token_ids")
    if body.logprob_token_ids:
        if logprobs is None:  # vLLM's words
            raise APIError(400, "when using `logprob_token_ids`, `logprobs` must be set"
                                + (" to true." if hasattr(body, "top_logprobs") else "."), param="logprob_token_ids")
        check_token_ids(body.logprob_token_ids, model, "logprob_token_ids")
    if body.length_penalty != 1.0 and not body.use_beam_search:
        raise APIError(400, "length_penalty ranks beams: it needs use_beam_search", param="length_penalty")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not available when streaming", param="prompt_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options")
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0), seed=body.seed,
        stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=logit_bias(body.logit_bias, model),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, guided=guided(body),
        allowed_token_ids=body.allowed_token_ids or [], logprob_token_ids=body.logprob_token_ids or [],
    )


def logit_bias(raw: dict[str, float] | None, model: ServedModel) -> dict[int, float]:
    if not raw:
        return {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(raw)}",
                       param="logit_bias")
    bias = {}
    for key, value in raw.items():
        if not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) < model.tokenizer.vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {model.tokenizer.vocab_size}), "
                                f"got {key!r}", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias[int(key)] = float(value)
    return bias


def whole_vocabulary(n: int | None, model: ServedModel) -> int | None:
    """vLLM's -1 for a number of logprobs: every token of the vocabulary."""
    return model.tokenizer.vocab_size if n == -1 else n


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None
