"""Constrained decoding (response_format) with llguidance: one grammar matcher per sequence.

Before a draw the matcher says which tokens the grammar allows next; after it, the matcher
consumes the drawn token. Once the JSON value is complete only EOS is allowed, so the output
always parses (unless max_tokens cuts it short, which finish_reason="length" tells).
"""

from __future__ import annotations

import llguidance
import torch

from shared.wire.guided import GuidedError, grammar_for
from shared.wire.messages import Guided

# the bit order of llguidance's mask: token 32*w + b is bit b of little-endian 32-bit word w
_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarCompiler:
    """Builds matchers over one tokenizer (building the token trie takes ~0.2 s, so once)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)

    def matcher(self, guided: Guided) -> GuidedMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_for(guided), log_level=0)
        if matcher.is_error():
            raise GuidedError(f"invalid JSON schema: {matcher.get_error()}")
        return GuidedMatcher(matcher, self.vocab_size)


class GuidedMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        return ((packed.unsqueeze(-1) >> _BITS) & 1).flatten()[: self.vocab_size].bool()

    def advance(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self.matcher.consume_token(token_id)
