"""Speculative decoding's draft_model method: a smaller model of the same vocabulary drafts each
row's next tokens greedily, its KV in the target's blocks, caught up on the tokens it has not seen."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends.base import Backend
from services.worker.loader import LoadedModel
from services.worker.sequence import SeqState
from shared.checks import ConfigError
from shared.speculative import SpeculativeConfig

# a row whose drafts were all rejected n steps in a row drafts at one output token in 2**n (n <= 4):
# a draft model that does not fit the text costs its forward at every step, an n-gram miss nothing
MAX_BACKOFF_LOG2 = 4


def check_draft_model(draft: LoadedModel, target: LoadedModel) -> LoadedModel:
    """The draft model, if it is a decoder of the target's vocabulary (a smaller model of its tokenizer)."""
    if draft.config.vocab_size != target.config.vocab_size or getattr(draft.model, "is_encoder", False):
        raise ConfigError(f"speculative_config: the draft model ({draft.config.architecture}, "
                          f"{draft.config.vocab_size} tokens) must be a decoder of the model's vocabulary "
                          f"({target.config.vocab_size} tokens): a smaller model of the same tokenizer")
    return draft


@dataclass
class _DraftRow:
    """A sequence as the draft model's forward sees it: its KV computed up to `draft_computed`, its
    tokens the known ones and the drafts so far; a row of several tokens is a prefill chunk."""

    seq: SeqState

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.draft_computed

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    draft_ids = ()  # the target's drafts are this model's outputs, not its inputs

    def input_ids(self, start: int, num: int) -> list[int]:
        known, drafts = self.seq.token_ids, self.seq.draft_ids
        if start >= len(known):  # a draft fed back: no copy of the context
            return drafts[start - len(known) : start - len(known) + num]
        return (known[start : start + num] + drafts)[:num]


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens

    def observe(self, backend, batch, starts, live) -> None:
        """Nothing: the draft model catches up on the known tokens as it drafts."""

    def propose_rows(self, backend: Backend, rows: list[tuple[SeqState, int]]) -> None:
        """Each row's draft_ids: up to `room` tokens, one draft forward per position over every
        drafting row at once. The first forward also computes the draft's KV of the tokens it has not
        seen (a new sequence's prompt, the target's last token, a draft it never ran), so a draft
        costs one token's forward of the draft model in the steady state. A row that keeps missing
        drafts less often (MAX_BACKOFF_LOG2)."""
        draft = backend.draft
        rows = [(seq, room) for seq, room in rows
                if room > 0 and seq.num_output_tokens % (1 << min(seq.num_missed, MAX_BACKOFF_LOG2)) == 0]
        batch = [(_DraftRow(seq), len(seq.token_ids) - seq.draft_computed) for seq, _ in rows]
        while batch:
            hidden = draft.forward(draft.prepare(batch))
            last = torch.tensor([n for _, n in batch], device=hidden.device).cumsum(0) - 1
            next_ids = draft.compute_logits(hidden.index_select(0, last)).argmax(-1).tolist()
            for (row, num_new), token_id in zip(batch, next_ids, strict=True):
                row.seq.draft_computed += num_new
                row.seq.draft_ids.append(token_id)
            batch = [(_DraftRow(seq), 1) for seq, room in rows if len(seq.draft_ids) < room]
