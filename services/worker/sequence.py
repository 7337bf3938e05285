"""Per-sequence state the worker keeps so decode steps carry only deltas."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from shared.messages import FinishReason, NewSeq, SamplingParams


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

    @classmethod
    def from_new(cls, new: NewSeq) -> SeqState:
        state = cls(
            request_id=new.request_id, token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens, num_computed_tokens=new.num_computed_tokens,
            block_table=list(new.block_ids), sampling=new.sampling, reply_to=new.reply_to,
            num_cached_tokens=new.num_cached_tokens, first_scheduled_at=new.first_scheduled_at,
        )
        if new.sampling.seed is not None:
            state.seed = new.sampling.seed
        return state

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def banned_ids(self, eos_token_ids: list[int]) -> list[int]:
        """Below min_tokens, EOS and stop tokens cannot be sampled."""
        if self.num_output_tokens >= self.sampling.min_tokens:
            return []
        return [*eos_token_ids, *self.sampling.stop_token_ids]

    def check_finished(self, token_id: int, eos_token_ids: list[int], max_model_len: int) -> FinishReason | None:
        """Called after token_id was appended."""
        p = self.sampling
        if self.num_output_tokens >= p.min_tokens:
            if (token_id in eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= p.max_tokens or len(self.token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None
