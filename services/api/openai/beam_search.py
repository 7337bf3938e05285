"""vLLM's beam search (`use_beam_search`, `n` beams, `length_penalty`), run by the gateway as vLLM
runs it: one engine token a live beam a step, its 2n likeliest kept as candidates."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.openai.format import Usage
from services.api.openai.generation import Delta, Generation, engine_request
from services.api.openai.protocol import _Sampling
from shared.wire.messages import SamplingParams

# what a beam search takes beside n, max_tokens, temperature, seed, ignore_eos, length_penalty and
# stream: each of these would change what one token of a beam is, which vLLM's search ignores
NOT_WITH_BEAMS = ("logprob_token_ids", "stop", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "logit_bias",
                  "min_tokens", "allowed_token_ids", "response_format", "guided_json", "guided_choice",
                  "guided_regex", "guided_grammar", "structured_outputs", "tools")


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far (a final EOS left out)
    cum_logprob: float = 0.0
    finished_by: int | None = None  # the EOS id that ended it

    def score(self, num_prompt: int, length_penalty: float) -> float:
        """vLLM's: the summed logprob over the length (prompt included) to the power length_penalty."""
        return self.cum_logprob / ((num_prompt + len(self.tokens)) ** length_penalty)


def check_beam_request(body: _Sampling, model: ServedModel) -> None:
    """A 400 naming what a beam search cannot take."""
    fields = type(body).model_fields
    for name in NOT_WITH_BEAMS:
        if name in fields and getattr(body, name) != fields[name].default:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
                          ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(body, name) not in (None, neutral):
            raise APIError(400, f"use_beam_search ranks beams by the model's logprobs: {name} cannot be combined "
                                "with it", param=name)
    if 2 * body.n > model.max_logprobs:
        raise APIError(400, f"use_beam_search with n={body.n} needs the {2 * body.n} likeliest tokens a step; "
                            f"this server gives at most {model.max_logprobs} (--max-logprobs)", param="n")


class BeamChoices:
    """The interface of choices.Choices (submit, deltas, usage, abort), for a beam search per
    prompt: choice index = prompt index * n + rank of the beam, best first."""

    def __init__(self, ctx: ApiContext, model: ServedModel, body: _Sampling, prompts: list[list[int]],
                 samplings: list[SamplingParams], arrived: tuple[float, float]):
        self.ctx, self.model, self.body = ctx, model, body
        self.prompts, self.samplings, self.arrived = prompts, samplings, arrived
        self.arrival = arrived[0]
        self.num_choices = len(prompts) * body.n
        self.length_penalty = body.length_penalty
        eos = model.tokenizer.eos_token
        self.eos_ids = set() if body.ignore_eos or eos is None else {model.tokenizer.tokenizer.token_to_id(eos)}
        self.first_token_at: float | None = None
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.request_id = ""
        self._in_flight: list[Generation] = []

    async def submit(self) -> None:
        """Nothing is held in the engine between steps: each step submits its own requests."""
        self.request_id = f"beam-{uuid.uuid4().hex}"

    async def abort(self) -> None:
        for gen in self._in_flight:
            if gen.stream is not None:
                await gen.stream.abort()

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Each prompt's n best beams, each as one delta with its whole text, once the search ends."""
        results = await asyncio.gather(*(self._search(p, ids, s) for p, (ids, s) in
                                         enumerate(zip(self.prompts, self.samplings, strict=True))))
        for p, beams in enumerate(results):
            for rank, beam in enumerate(beams):
                finish = "stop" if beam.finished_by is not None else "length"
                yield p * self.body.n + rank, Delta(self.model.tokenizer.decode(beam.tokens), finish,
                                                    tuple(beam.tokens), stop_reason=beam.finished_by)

    async def _search(self, p: int, prompt: list[int], sampling: SamplingParams) -> list[Beam]:
        n, live, done = self.body.n, [Beam()], []
        step = msgspec.structs.replace(sampling, max_tokens=1, logprobs=2 * n, ignore_eos=True)
        for _ in range(sampling.max_tokens):
            candidates = []
            for beam, (token_ids, logprobs) in zip(live, await asyncio.gather(
                    *(self._one_token(prompt + beam.tokens, step) for beam in live)), strict=True):
                for token_id, logprob in {**dict(zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)),
                                          token_ids[0]: logprobs.logprob}.items():
                    grown = Beam(beam.tokens + [token_id], beam.cum_logprob + logprob)
                    if token_id in self.eos_ids:
                        done.append(Beam(beam.tokens, grown.cum_logprob, finished_by=token_id))
                    else:
                        candidates.append(grown)
            live = sorted(candidates, key=lambda b: b.score(len(prompt), self.length_penalty), reverse=True)[:n]
            if not live:
                break
        best = sorted(done + live, key=lambda b: b.score(len(prompt), self.length_penalty), reverse=True)[:n]
        self.num_output_tokens += sum(len(b.tokens) for b in best)
        return best

    async def _one_token(self, ids: list[int], sampling: SamplingParams):
        """One engine request for one token and its 2n likeliest; the prefix cache holds the beam."""
        gen = engine_request(self.ctx, self.model, self.body, ids, sampling, self.arrived, stop=[])
        self._in_flight.append(gen)
        try:
            await gen.submit()
            token_ids, logprobs = [], []
            async for delta in gen.deltas():
                token_ids += delta.token_ids
                logprobs += delta.logprobs or []
        finally:
            self._in_flight.remove(gen)
        if self.first_token_at is None:
            self.first_token_at = gen.first_token_at
            self.num_cached_tokens = gen.num_cached_tokens
        if not token_ids or not logprobs:
            raise APIError(503, "the engine returned no token for a beam", code="unavailable")
        return token_ids, logprobs[0]

    def usage(self) -> Usage:
        now = time.monotonic()
        return Usage(prompt_tokens=sum(map(len, self.prompts)), completion_tokens=self.num_output_tokens,
                     cached_tokens=self.num_cached_tokens, ttft=(self.first_token_at or now) - self.arrival,
                     tps=self.num_output_tokens / max(now - self.arrival, 1e-9))

