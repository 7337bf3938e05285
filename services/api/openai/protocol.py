"""OpenAI request bodies, validated with pydantic. A field no model here declares is refused by
name (body.py), unless it is null, or a chat message's own (the template's to read)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 128  # OpenAI's own cap on choices per request
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap on logprob_token_ids


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the usage so far on every chunk (include_usage too)


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None  # for the model's benefit in OpenAI's API; the schema alone binds here
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Request):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; -1 or 0 keeps every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's bounds, and so its words
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions (params.py gives each its effect)
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_regex: str | None = None
    guided_grammar: str | None = None  # llguidance's Lark dialect
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    # vLLM's: the logprobs of exactly these tokens (and the sampled one's), in place of the top ones
    logprob_token_ids: list[int] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS)
    return_tokens_as_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: an outside router's disaggregated prefill (kv_transfer.py)
    return_token_ids: bool | None = None  # vLLM: the prompt's and each choice's token ids beside the text
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM: keep k prompt tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # which ones: the last k (left) or the first (right)
    # vLLM: each prompt token's logprob, rank, top-k; -1 (here and in logprobs): the whole vocabulary
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    use_beam_search: bool = False  # vLLM's: n beams searched by the gateway (beam_search.py)
    length_penalty: float = 1.0  # a beam's score: its logprob over its length to this power (beams only)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # vLLM: lower is served first (scheduler.py)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=-1)

    @model_validator(mode="before")
    @classmethod
    def _has_prompt(cls, data):
        if isinstance(data, dict) and data.get("prompt") is None:  # vLLM's words, which clients match on
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return data


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str = Field(min_length=1)  # a data URL or an http(s) one (services/api/media/fetch.py)
    # OpenAI's; a model whose vision tower takes one resolution (Gemma 3's) reads every image at it,
    # as vLLM does (docs/images.md)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    """OpenAI's roles, or one of the caller's own ("my-custom-role"), rendered by the chat template as
    vLLM renders it. Fields this model does not declare reach the template too (template_messages):
    a template may read them, as vLLM's do, so they are context, not arguments refused by name."""

    extra_is_template_context: ClassVar[bool] = True  # body.unrecognized() lets them through
    role: str = Field(min_length=1)
    content: list[ContentPart] | str | None = None  # the list first: its errors name the part at fault
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    refusal: str | None = None  # an assistant's refusal, in the history (OpenAI's field): its text

    @model_validator(mode="before")
    @classmethod
    def _unpack_provider_fields(cls, data):
        """LiteLLM hands back the fields of our answer it does not model (`refusal`) inside
        `provider_specific_fields`, and sends them so in the history: read them as the message's
        own fields (one no message declares is still refused by name)."""
        if isinstance(data, dict) and isinstance(data.get("provider_specific_fields"), dict):
            data = {**data["provider_specific_fields"], **data}
            del data["provider_specific_fields"]
        return data

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[ImageURL]:
        return [] if isinstance(self.content, str | None) else [
            part.image_url for part in self.content if isinstance(part, ImagePart)]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False  # vLLM: continue the final assistant message (add_generation_prompt false)
    echo: bool = False  # vLLM: a final assistant message's text comes first in the answer's content
    include_reasoning: bool = True  # vLLM: false leaves the thinking (--reasoning-parser's) out of the answer
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: more variables for the chat template (enable_thinking)
    thinking_token_budget: int | None = Field(default=None, ge=1)  # tokens the thinking may take (openai/thinking.py)
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM: the image processor's settings (media/processor.py)


class TokenizeRequest(_Request):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM: the vocabulary's strings of the tokens beside their ids
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # the tokenizer's BOS; None: as the completion would encode it
    tools: list[Tool] | None = None  # messages: rendered as the chat completion renders them
    chat_template_kwargs: dict[str, Any] | None = None  # messages: as the chat completion passes them
    mm_processor_kwargs: dict[str, Any] | None = None  # messages: as the chat completion's images take them


class DetokenizeRequest(_Request):
    model: str
    tokens: list[int]
