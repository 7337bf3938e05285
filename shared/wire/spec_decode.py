"""Speculative decoding on the wire: a row's drafts in a StepResult, and vLLM's counters over them."""

from __future__ import annotations

import msgspec


class Drafts(msgspec.Struct, array_like=True):
    """One row's speculation in a step: how many draft tokens it verified, how many were accepted."""

    request_id: str
    num_drafted: int
    num_accepted: int


class SpecDecodeCounts(msgspec.Struct):
    """vLLM's spec_decode counters: rows that verified drafts, the draft tokens, those accepted,
    and accepted at each draft position (index 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []

    def observe(self, drafts: list[Drafts]) -> None:
        for row in drafts:
            self.num_drafts += 1
            self.num_draft_tokens += row.num_drafted
            self.num_accepted_tokens += row.num_accepted
            self._widen(row.num_drafted)
            for pos in range(row.num_accepted):
                self.accepted_per_pos[pos] += 1

    def add(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._widen(len(other.accepted_per_pos))
        for pos, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += n

    def _widen(self, width: int) -> None:
        self.accepted_per_pos += [0] * (width - len(self.accepted_per_pos))
