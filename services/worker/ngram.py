"""Prompt lookup (vLLM's "ngram" speculative method): draft the tokens that followed an earlier
occurrence of the context's own longest suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from services.worker.sequence import SeqState
from shared.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_rows(self, backend, rows: list[tuple[SeqState, int]]) -> None:
        """Each row's draft_ids, up to its room (the backend is the draft_model method's)."""
        for seq, room in rows:
            seq.draft_ids = self.propose(seq.token_ids, room)

    def observe(self, backend, batch, starts, live) -> None:
        """Nothing: a proposal reads the context alone."""

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens: those after an earlier match of the longest suffix of min_n..max_n
        tokens (a longer match wins; among equals, the latest with max_drafts tokens after it, else the
        latest); [] when none matches."""
        n, length = self.min_n, len(token_ids)
        if max_drafts <= 0 or length <= n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # starts of earlier windows equal to the last n tokens, each followed by at least one token
        starts = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(axis=1))
        if starts.size == 0:
            return []
        for longer in range(1, self.max_n - n + 1):  # grow the match backwards, one token at a time
            longer_starts = starts[starts >= longer]
            longer_starts = longer_starts[tokens[longer_starts - longer] == tokens[length - n - longer]]
            if longer_starts.size == 0:
                break
            starts = longer_starts
        whole = starts[starts + n + max_drafts <= length]
        best = whole[-1] if whole.size else starts[-1]
        return tokens[best + n : best + n + max_drafts].tolist()
