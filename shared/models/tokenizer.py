"""The tokenizer, special tokens and chat template of a model, built from GGUF metadata or an HF dir.

Building a `tokenizers.Tokenizer` from GGUF arrays is slow, so the result is cached as tokenizer.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import msgspec
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shared.models import spm_tokenizer
from shared.models.architectures import ENCODER_ARCHITECTURES
from shared.models.gguf_fields import is_gguf, read_fields
from shared.models.model_files import cache_dir_for

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    context_length: int
    post_process: bool = False  # an encoder's: tokenizer.json's own template adds its tokens ([CLS] ... [SEP])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: the BOS the model's tokenizer adds (if it adds one, and the text lacks it),
        or an encoder's [CLS] and [SEP]."""
        if self.post_process:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos_id = self.tokenizer.token_to_id(self.bos_token)
            if not ids or ids[0] != bos_id:
                ids = [bos_id, *ids]
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A cross-encoder's input, by tokenizer.json's pair template ([CLS] first [SEP] second [SEP])."""
        return self.tokenizer.encode(first, second, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest token's byte length: a text of n bytes is at least n / this many tokens."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size)) or 1

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a token may hold part of a UTF-8 character)."""
        return _token_bytes(self.tokenizer, token_id)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_string(self, token_id: int) -> str:
        """The vocabulary's own string for a token ("Ġis" in a byte-level BPE), as vLLM's /tokenize lists it."""
        return self.tokenizer.id_to_token(token_id) or ""


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


@lru_cache(maxsize=1 << 17)
def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if token_id not in tokenizer.get_added_tokens_decoder() and isinstance(tokenizer.model, models.BPE) \
            and tokenizer.model.byte_fallback:  # SentencePiece's spelling: SPACE for a space, <0x0A> for a byte
        return spm_tokenizer.piece_bytes(piece)
    if token_id in tokenizer.get_added_tokens_decoder() or not isinstance(tokenizer.decoder, decoders.ByteLevel):
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            return tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return piece.encode()
    return bytes(_BYTE_LEVEL[c] for c in piece)


class _Meta(msgspec.Struct):
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    context_length: int


def load_tokenizer(path: str) -> ModelTokenizer:
    if is_gguf(path):
        return _from_gguf(path)
    return _from_hf_dir(Path(path))


def _from_gguf(path: str) -> ModelTokenizer:
    cache = cache_dir_for(path, "tokenizer-v1")
    if (cache / "tokenizer.json").exists() and (cache / "meta.json").exists():
        meta = msgspec.json.decode((cache / "meta.json").read_bytes(), type=_Meta)
        return ModelTokenizer(Tokenizer.from_file(str(cache / "tokenizer.json")), **msgspec.structs.asdict(meta))
    fields = read_fields(path, with_vocab=True)
    kind = fields.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(fields)
    elif kind == "llama":  # SentencePiece: Llama 2, Phi-3, Gemma
        tokenizer = spm_tokenizer.build(fields)
    else:
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (gpt2's byte-level BPE, "
                         "llama's SentencePiece)")
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields["tokenizer.ggml.token_type"]
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tokenizer.add_special_tokens(special)

    def token(key: str) -> str | None:
        idx = fields.get(key)
        return tokens[idx] if idx is not None else None

    meta = _Meta(
        chat_template=fields.get("tokenizer.chat_template"),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        context_length=int(fields[f"{fields['general.architecture']}.context_length"]),
    )
    _write_atomic(cache / "tokenizer.json", tokenizer.to_str().encode())
    _write_atomic(cache / "meta.json", msgspec.json.encode(meta))
    return ModelTokenizer(tokenizer, **msgspec.structs.asdict(meta))


def _byte_level_bpe(fields: dict) -> Tokenizer:
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if fields.get("tokenizer.ggml.pre") == "smollm":  # SmolLM's own tokenizer splits digits one by one
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _special(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_hf_dir(root: Path) -> ModelTokenizer:
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    cfg_path = root / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    model_cfg = json.loads((root / "config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text()
    return ModelTokenizer(
        tokenizer=tokenizer, chat_template=template,
        bos_token=_special(tok_cfg.get("bos_token")), eos_token=_special(tok_cfg.get("eos_token")),
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
        context_length=int(model_cfg.get("max_position_embeddings", 2048)),
        post_process=(model_cfg.get("architectures") or [""])[0] in ENCODER_ARCHITECTURES,
    )
