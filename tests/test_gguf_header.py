"""shared/models/gguf_fields.read_header against gguf-py's GGUFReader (the oracle): the same metadata,
values and types, and the same tensors (names, types, shapes, bytes), on SmolLM2's file and on one
gguf-py's writer fills with every value type, tensor kind and a custom alignment."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from shared.models.gguf_fields import read_fields, read_header  # noqa: E402


def _assert_as_gguf_py(path: str) -> None:
    ours, reader = read_header(path), gguf.GGUFReader(path)
    theirs = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.fields) == list(theirs)
    for name, value in theirs.items():
        assert ours.fields[name] == value and type(ours.fields[name]) is type(value), name
    assert len(ours.tensors) == len(reader.tensors)
    for mine, their in zip(ours.tensors, reader.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape) == (their.name, their.tensor_type, tuple(their.shape.tolist()))
        assert mine.data.dtype == their.data.dtype and mine.data.shape == their.data.shape, mine.name
        assert np.array_equal(np.asarray(mine.data), np.asarray(their.data)), mine.name


def test_smollm2s_file_reads_as_gguf_pys_reader_reads_it(default_model_path):
    _assert_as_gguf_py(default_model_path)
    fields = read_fields(default_model_path)
    assert "tokenizer.ggml.tokens" not in fields and len(read_fields(default_model_path, with_vocab=True)
                                                         ["tokenizer.ggml.tokens"]) == 49152
    assert fields["__tensor_types__"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])  # a big-endian file is left to gguf-py's reader
def test_every_value_type_and_tensor_kind_reads_as_gguf_pys_reader_reads_it(tmp_path, endian):
    path = str(tmp_path / "every.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian[endian])
    w.add_custom_alignment(64)
    for i, kind in enumerate(("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")):
        getattr(w, f"add_{kind}")(f"test.{kind}", i + 1 if kind.startswith("u") else -i - 1)
    w.add_float32("test.float32", 0.1)
    w.add_float64("test.float64", 0.1)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.strings", ["a", "", "ü" * 300])
    w.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", floats)
    w.add_tensor("f16", floats.astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in ("Q8_0", "Q4_0", "BF16"):
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(kind.lower(), gguf.quants.quantize(floats, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_as_gguf_py(path)
