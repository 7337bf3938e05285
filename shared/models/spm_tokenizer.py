"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` = llama: Llama 2, Phi-3, Gemma) as a
`tokenizers` BPE with byte fallback, its merges recovered from the vocabulary's priorities."""

from __future__ import annotations

import re

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # SentencePiece's stand-in for a space
_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def build(fields: dict) -> Tokenizer:
    """The tokenizer llama.cpp's vocabulary describes. A piece merges from every split of it into two
    pieces of the vocabulary, the better-scored pieces first: by the file's scores, or for Gemma
    (whose scores do not follow its merges) by the file's order, as transformers rebuilds it."""
    arch = fields["general.architecture"]
    tokens = list(fields["tokenizer.ggml.tokens"])
    gemma = arch.startswith("gemma")
    if gemma:  # its runs of spaces are stored as spaces; the text's spaces arrive as SPACE
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        priority = {t: -i for i, t in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, fields["tokenizer.ggml.scores"], strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab, _merges(vocab, priority), unk_token=tokens[unk] if unk is not None else None,
                       fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", not gemma))
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    elif arch == "phi3":  # its own tokenizer.json: the prefix from a normalizer, so leading spaces add one more
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix
                                                           else "never", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * (prefix and not gemma))
    return tokenizer


def _merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    found = []
    for piece in vocab:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-priority[piece], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: a byte token's byte, SPACE as a space."""
    if match := _BYTE.match(piece):
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPACE, " ").encode()
