"""Speculative decoding's eagle3 method: an EAGLE-3 head drafts from the target's own hidden states,
its one layer's KV in the target's blocks (models/eagle3.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.draft_proposer import MAX_BACKOFF_LOG2
from services.worker.sequence import SeqState
from shared.speculative import SpeculativeConfig


@dataclass
class _HeadRow:
    """A sequence as the head's forward sees it: at position p it reads token p + 1 (the target's
    state at p and the token sampled from it predict token p + 2), from `start` on."""

    seq: SeqState
    num_computed_tokens: int
    draft_ids = ()  # a row of several tokens is a chunk of known ones

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    def input_ids(self, start: int, num: int) -> list[int]:
        known = self.seq.token_ids[start + 1 : start + 1 + num]
        return known if len(known) == num else [self.seq.draft_ids[-1]]  # a draft fed back


class Eagle3Proposer:
    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_batch = config.max_batch

    def observe(self, backend, batch: list[tuple[SeqState, int]], starts: list[int], live: dict) -> None:
        """After the target's forward: the head reads the target's states at each row's newly computed
        positions (their KV kept in the head's layer), and for a row whose known tokens are all
        computed, drafts the first token of its next step. A decoding row that will not draft next
        step (backing off) keeps its states for later instead (`SeqState.pending_aux`: at most
        2**MAX_BACKOFF_LOG2 positions). A step of more rows than speculate skips the head (its KV then
        misses those positions, which costs acceptance and never exactness)."""
        if len(batch) > self.max_batch:
            for seq, _ in batch:
                seq.head_state, seq.pending_aux = None, None
            return
        aux, drafter = backend.model.aux_hidden, backend.draft
        rows, states, offset = [], [], 0
        for (seq, num_new), start in zip(batch, starts, strict=True):
            first, end = max(seq.draft_computed, start), min(seq.num_computed_tokens, len(seq.token_ids) - 1)
            pending, seq.head_state, seq.pending_aux = seq.pending_aux, None, None
            if seq.request_id in live and seq.sampling.pooling is None and end > first:
                new = aux[offset + first - start : offset + end - start]
                if pending is not None and seq.draft_computed + len(pending) == first:  # still in line
                    first, new = seq.draft_computed, torch.cat([pending, new])
                if seq.num_output_tokens and not _drafts_at(seq):
                    seq.pending_aux = new
                    seq.draft_computed = first  # the positions before are in the head's KV
                else:
                    rows.append((_HeadRow(seq, first), end - first))
                    states.append(new)
            offset += num_new
        if not rows:
            return
        out, normed = drafter.forward(rows, drafter.head.fuse(torch.cat(states)))
        last = (torch.tensor([n for _, n in rows]).cumsum(0) - 1).tolist()
        for row, num in rows:
            row.seq.draft_computed = row.num_computed_tokens + num
        ready = [(row.seq, i) for (row, _), i in zip(rows, last, strict=True)
                 if row.seq.draft_computed == row.seq.num_computed_tokens == len(row.seq.token_ids) - 1]
        if ready:
            tokens = drafter.head.draft_tokens(normed[[i for _, i in ready]])
            for (seq, i), token in zip(ready, tokens, strict=True):
                seq.head_state = (out[i], token)

    def propose_rows(self, backend, rows: list[tuple[SeqState, int]]) -> None:
        """Each row's draft_ids: the first drafted after the last step, the rest one head forward per
        position over every drafting row at once, each from the head's own last state."""
        drafter = backend.draft
        rows = [(seq, room) for seq, room in rows if room > 0 and seq.head_state is not None
                and seq.draft_computed == seq.num_computed_tokens and _drafts_at(seq)]
        for seq, _ in rows:
            seq.draft_ids = [seq.head_state[1]]
        hidden = {seq.request_id: seq.head_state[0] for seq, _ in rows}
        batch = [seq for seq, room in rows if room > 1]
        while batch:
            views = [(_HeadRow(seq, seq.num_computed_tokens + len(seq.draft_ids) - 1), 1) for seq in batch]
            out, normed = drafter.forward(views, torch.stack([hidden[seq.request_id] for seq in batch]))
            for i, (seq, token) in enumerate(zip(batch, drafter.head.draft_tokens(normed), strict=True)):
                seq.draft_ids.append(token)
                hidden[seq.request_id] = out[i]
            batch = [seq for seq, room in rows if len(seq.draft_ids) < room]


def _drafts_at(seq: SeqState) -> bool:
    """Whether a row drafts at its current output token: always, but one in 2**n while its last n
    steps' drafts were all rejected (as the draft model's rows back off)."""
    return seq.num_output_tokens % (1 << min(seq.num_missed, MAX_BACKOFF_LOG2)) == 0
