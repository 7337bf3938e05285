"""Per-sequence state the worker keeps so decode steps carry only deltas."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from services.worker.guided import GuidedMatcher
from services.worker.logits_processors import SampleRow
from shared.wire.images import ImageRef
from shared.wire.messages import FinishReason, Logprobs, NewSeq, SamplingParams


@dataclass
class SeqState:
    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    sampling: SamplingParams
    reply_to: str
    num_cached_tokens: int
    first_scheduled_at: float
    seed: int = field(default_factory=lambda: secrets.randbits(62))
    matcher: GuidedMatcher | None = None
    # prompt logprobs gathered chunk by chunk; sent with the first token, then dropped
    prompt_logprobs: list[Logprobs | None] | None = None
    # what was published, so it can be sent again (services/worker/resend.py): output tokens
    # [0, num_sent), their logprobs from logprobs_from on (a recomputed sequence lost the earlier
    # ones, and only the latest KEEP_LOGPROBS or so are kept)
    num_sent: int = 0
    logprobs_from: int = 0
    sent_logprobs: list[Logprobs] = field(default_factory=list)
    sent_prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: FinishReason | None = None  # once the final entry was published
    embedding: bytes | None = None  # a pooling request's output, once computed
    lora: str | None = None  # the LoRA adapter its rows run on
    # speculative decoding: tokens proposed after token_ids, computed in this step's forward to be verified
    draft_ids: list[int] = field(default_factory=list)
    max_drafts: int = 0  # the most it drafts next step, after how its last drafts fared (0: as many as allowed)
    draft_computed: int = 0  # draft_model, eagle3: positions whose KV the draft model or head holds (a prefix)
    num_missed: int = 0  # steps in a row whose drafts were all rejected
    # the eagle3 method: the head's state after the last computed position and the token it drafts there
    head_state: tuple[object, int] | None = None
    images: list[ImageRef] = field(default_factory=list)  # its prompt's images (services/worker/images.py)
    pending_aux: object | None = None  # eagle3: the target's states at the positions after draft_computed

    @classmethod
    def from_new(cls, new: NewSeq) -> SeqState:
        state = cls(
            request_id=new.request_id, token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens, num_computed_tokens=new.num_computed_tokens,
            block_table=list(new.block_ids), sampling=new.sampling, reply_to=new.reply_to,
            num_cached_tokens=new.num_cached_tokens, first_scheduled_at=new.first_scheduled_at, lora=new.lora,
            images=list(new.images),
        )
        state.num_sent = state.logprobs_from = state.num_output_tokens  # an earlier life published those
        if new.sampling.seed is not None:
            state.seed = new.sampling.seed
        if new.sampling.prompt_logprobs is not None and state.num_output_tokens == 0:
            state.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        return state

    def input_ids(self, start: int, num: int) -> list[int]:
        """The tokens at positions [start, start + num): known ones, then drafts."""
        ids = self.token_ids[start : start + num]
        if len(ids) < num:
            ids = ids + self.draft_ids[: num - len(ids)]
        return ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def sample_row(self, eos_token_ids: list[int]) -> SampleRow:
        p = self.sampling
        return SampleRow(
            params=p, seed=self.seed, output_index=self.num_output_tokens,
            prompt_ids=self.token_ids[: self.num_prompt_tokens] if p.repetition_penalty != 1.0 else [],
            output_ids=self.output_ids if p.has_penalties else [],
            banned_ids=self.banned_ids(eos_token_ids),
            allowed=self.matcher.allowed() if self.matcher is not None else None,
        )

    def banned_ids(self, eos_token_ids: list[int]) -> list[int]:
        """Below min_tokens, EOS and stop tokens cannot be sampled (a grammar overrides that)."""
        if self.num_output_tokens >= self.sampling.min_tokens or self.matcher is not None:
            return []
        return [*eos_token_ids, *self.sampling.stop_token_ids]

    def check_finished(self, token_id: int, eos_token_ids: list[int], max_model_len: int) -> FinishReason | None:
        """Called after token_id was appended."""
        p = self.sampling
        if self.num_output_tokens >= p.min_tokens or self.matcher is not None:
            if (token_id in eos_token_ids and (not p.ignore_eos or self.matcher is not None)) \
                    or token_id in p.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= p.max_tokens or len(self.token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None
