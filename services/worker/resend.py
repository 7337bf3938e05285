"""Tokens sent again: a bus client that may have missed some (an outage) asks from an offset on.

The worker answers from its sequence table, and for sequences that already finished from a
bounded memory of the latest ones, so a lost final entry is recoverable too.
"""

from __future__ import annotations

from collections import OrderedDict

from services.worker.sequence import SeqState
from shared.wire.messages import FinishReason, TokenEntry

MAX_FINISHED = 1024  # finished sequences remembered for a late Resend
KEEP_LOGPROBS = 256  # the latest tokens' logprobs kept per sequence (top-20 alternatives are ~1 KB a token)


class SentTokens:
    def __init__(self, live: dict[str, SeqState]):
        self.live = live  # the runner's sequence table
        self.finished: OrderedDict[str, SeqState] = OrderedDict()

    def record(self, seq: SeqState, entry: TokenEntry) -> None:
        """What was just published for `seq`: its count, its finish, the logprobs' bounded tail."""
        seq.num_sent, seq.finish_reason = entry.offset + len(entry.token_ids), entry.finish_reason
        if entry.logprobs is not None:
            seq.sent_logprobs += entry.logprobs
            if len(seq.sent_logprobs) > 2 * KEEP_LOGPROBS:  # trimmed now and then, not every token
                del seq.sent_logprobs[:-KEEP_LOGPROBS]
                seq.logprobs_from = seq.num_sent - KEEP_LOGPROBS
        if entry.offset == 0:
            seq.sent_prompt_logprobs = entry.prompt_logprobs

    def remember_finished(self, seqs: dict[str, SeqState]) -> None:
        for request_id, seq in seqs.items():
            self.finished[request_id] = seq
            self.finished.move_to_end(request_id)
        while len(self.finished) > MAX_FINISHED:
            self.finished.popitem(last=False)

    def entry_from(self, request_id: str, reply_to: str, offset: int) -> TokenEntry | None:
        """The request's tokens from offset on as one entry; None if this worker does not hold it
        (or has nothing past offset yet)."""
        seq = self.live.get(request_id) or self.finished.get(request_id)
        if seq is None or seq.reply_to != reply_to or offset < 0:
            return None
        end = seq.num_sent
        if offset > end or (offset == end and seq.finish_reason is None):
            return None
        entry = TokenEntry(request_id=request_id, offset=offset, token_ids=seq.output_ids[offset:end],
                           finish_reason=seq.finish_reason, embedding=seq.embedding)
        if seq.sampling.logprobs is not None:
            if offset < seq.logprobs_from:
                return TokenEntry(request_id=request_id, offset=offset, token_ids=[], finish_reason=FinishReason.ERROR,
                                  error="tokens lost in a bus outage could not be sent again with their logprobs")
            entry.logprobs = seq.sent_logprobs[offset - seq.logprobs_from : end - seq.logprobs_from]
        if offset == 0:
            entry.num_prompt_tokens, entry.num_cached_tokens = seq.num_prompt_tokens, seq.num_cached_tokens
            entry.first_scheduled_at, entry.prompt_logprobs = seq.first_scheduled_at, seq.sent_prompt_logprobs
        return entry
