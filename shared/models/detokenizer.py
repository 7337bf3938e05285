"""Incremental detokenization (right for multi-byte characters) and stop strings.

Text that could still become a stop string is held back until it cannot; the stop string itself
is never returned.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # after a fallback: ids[prefix:read] decoded already, for context
        self.stop = [s for s in stop if s]
        self.pending = ""  # decoded but not yet released (could begin a stop string)
        self.is_stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text now safe to release (stops at a stop string)."""
        if self.is_stopped:
            return ""
        for token_id in token_ids:
            self.ids.append(token_id)
            piece = self._step(token_id)
            if piece:
                self.pending += piece
        return self._release()

    def _step(self, token_id: int) -> str | None:
        if self.stream is not None:
            try:
                return self.stream.step(self.tokenizer, token_id)
            except Exception:  # tokenizers' stream refuses a decoded prefix that changed
                # (byte-fallback pieces that are not UTF-8 yet, then are): go on by offsets, as vLLM
                # detokenizes, from a few tokens back for the context a piece's spaces need
                self.stream = None
                self.read = len(self.ids) - 1
                self.prefix = max(0, self.read - 5)
        seen = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special_tokens)
        if len(text) <= len(seen) or text.endswith("\ufffd"):  # nothing new, or a character not whole yet
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """The stream ended: whatever is held back is final text."""
        if self.is_stopped:
            return ""
        text, self.pending = self.pending, ""
        return text

    def _release(self) -> str:
        for stop in self.stop:
            at = self.pending.find(stop)
            if at != -1:
                self.is_stopped, self.matched_stop = True, stop
                text, self.pending = self.pending[:at], ""
                return text
        keep = max((_overlap(self.pending, stop) for stop in self.stop), default=0)
        cut = len(self.pending) - keep
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
