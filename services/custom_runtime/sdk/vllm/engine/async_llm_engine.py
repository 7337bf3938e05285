"""vLLM's AsyncLLMEngine over Switchyard's bus: generate() submits to the deployment's scheduler,
so a custom runtime's requests are continuously batched with every other request to the model."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

from services.custom_runtime import context
from shared.models.detokenizer import IncrementalDetokenizer
from shared.wire.messages import FinishReason
from shared.wire.messages import SamplingParams as EngineSampling
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams


class AsyncLLMEngine:
    def __init__(self, ctx: context.RuntimeContext):
        self.ctx = ctx
        self.streams = {}

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> AsyncLLMEngine:
        ctx = context.CURRENT
        if ctx is None:
            raise RuntimeError("this vLLM engine API runs inside a Switchyard custom runtime")
        wanted = os.path.realpath(engine_args.model)
        if wanted not in (os.path.realpath(ctx.model_path), os.path.realpath(os.path.dirname(ctx.model_path))):
            raise ValueError(f"AsyncEngineArgs(model={engine_args.model!r}): this runtime's engine serves "
                             f"{ctx.model_path}, the model in the uploaded artifact")
        return cls(ctx)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """prompt: text, {"prompt": text} or {"prompt_token_ids": [...]}; yields the output so far.
        priority: the scheduler serves lower first (vLLM's meaning)."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if ids is None:
            if not isinstance(text, str):
                raise TypeError(f"prompt must be text or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
            ids = self.ctx.tokenizer.encode(text)
        p = sampling_params
        sampling = EngineSampling(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                  top_k=max(p.top_k, 0), seed=p.seed, stop_token_ids=p.stop_token_ids,
                                  ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, min_p=p.min_p,
                                  presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                  repetition_penalty=p.repetition_penalty)
        stream = await self.ctx.bus.submit(self.ctx.model, ids, sampling, priority=priority,
                                           request_id=f"custom-{request_id or uuid.uuid4().hex}")
        detok = IncrementalDetokenizer(self.ctx.tokenizer.tokenizer, p.stop, p.skip_special_tokens)
        out = CompletionOutput(index=0, text="", token_ids=[])
        finished = False
        try:
            async for entry in stream.entries():
                out.token_ids = out.token_ids + list(entry.token_ids)
                out.text += detok.push(list(entry.token_ids))
                if entry.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT):
                    raise RuntimeError(entry.error or "the engine failed this request")
                if detok.is_stopped:
                    out.finish_reason = "stop"
                elif entry.finish_reason is not None:
                    out.text += detok.flush()
                    out.finish_reason = entry.finish_reason.openai_name
                finished = out.finish_reason is not None
                yield RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                    outputs=[CompletionOutput(**vars(out))], finished=finished)
                if finished:
                    return
        finally:
            if not finished:
                await stream.abort()

    async def abort(self, request_id: str) -> None:
        await self.ctx.bus.abort(self.ctx.model, [f"custom-{request_id}"])

    async def get_tokenizer(self):
        return self.ctx.tokenizer.tokenizer
