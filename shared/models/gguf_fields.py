"""Reading a GGUF file's metadata (both the API's tokenizer and the worker's loader need it)."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import gguf

# large arrays are read only when asked for: they cost seconds to decode
_LAZY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (IsADirectoryError, FileNotFoundError):
        return False


@lru_cache(maxsize=4)
def read_fields(path: str, with_vocab: bool = False) -> dict:
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, field in reader.fields.items():
        if name in _LAZY_ARRAYS and not with_vocab:
            continue
        fields[name] = field.contents()
    fields["__tensor_names__"] = [t.name for t in reader.tensors]
    fields["__tensor_types__"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    return fields
