"""Reading a GGUF file's header: its metadata (the API's tokenizer and the worker's loader need it)
and where each tensor's bytes are, in one pass over the file's front."""

from __future__ import annotations

import struct
from collections import Counter
from functools import lru_cache
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

# large arrays are left out of read_fields unless asked for: a tokenizer's vocabulary
_LAZY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
            GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
            GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
# what a tensor's bytes are as numbers; any other type is its blocks' bytes, as gguf-py gives them
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


class Tensor(NamedTuple):
    """As gguf-py's ReaderTensor has them: `shape` in ggml's order (innermost first), `data` a view of
    the file shaped [..., rows, row] (a quantized type's rows as bytes)."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class Header(NamedTuple):
    fields: dict[str, Any]  # by key, each value as gguf-py's field.contents() gives it
    tensors: list[Tensor]


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (IsADirectoryError, FileNotFoundError):
        return False


class _Cursor:
    """Little-endian values read off the file's bytes (gguf-py's reader makes a numpy view of each:
    seconds for a vocabulary of 50k strings)."""

    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return str(self.buf[self.at - n : self.at], "utf-8")

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.take(_SCALARS[GGUFValueType(kind)])
        item, count = self.take("I"), self.take("Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [self.value(item) for _ in range(count)]
        fmt = _SCALARS[GGUFValueType(item)]
        values = np.frombuffer(self.buf, np.dtype("<" + fmt), count, self.at).tolist()
        self.at += count * struct.calcsize(fmt)
        return values


def read_header(path: str) -> Header:
    """The metadata and the tensors of a little-endian GGUF (versions 2 and 3); another is read by
    gguf-py's reader."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if cursor.take("I") != gguf.GGUF_MAGIC or cursor.take("I") not in (2, 3):
        return _header_from_gguf_py(gguf.GGUFReader(path))
    num_tensors, num_fields = cursor.take("Q"), cursor.take("Q")
    fields = {}
    for _ in range(num_fields):
        name = cursor.string()
        fields[name] = cursor.value(cursor.take("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        infos.append((name, GGMLQuantizationType(cursor.take("I")), dims, cursor.take("Q")))
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        rows = tuple(reversed(dims))
        count = int(np.prod(dims))
        if kind in _ELEMENTS:
            end = start + offset + count * np.dtype(_ELEMENTS[kind]).itemsize
            array = data[start + offset : end].view(_ELEMENTS[kind]).reshape(rows)
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            array = data[start + offset : start + offset + count * type_size // block_size].reshape(
                quant_shape_to_byte_shape(rows, kind))
        tensors.append(Tensor(name, kind, dims, array))
    return Header(fields, tensors)


def _header_from_gguf_py(reader: gguf.GGUFReader) -> Header:
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return Header(fields, [Tensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors])


@lru_cache(maxsize=4)
def read_fields(path: str, with_vocab: bool = False) -> dict:
    header = read_header(path)
    fields = {name: value for name, value in header.fields.items() if with_vocab or name not in _LAZY_ARRAYS}
    fields["__tensor_names__"] = [t.name for t in header.tensors]
    fields["__tensor_types__"] = dict(Counter(t.tensor_type.name for t in header.tensors))
    return fields
