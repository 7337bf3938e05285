"""A model's Arrow schemas: the product's own base64 strings, pyarrow schemas from the SDK, and
what the records route checks and shapes with them."""

from __future__ import annotations

import base64

import pyarrow as pa
import pytest

from shared.config import ConfigError
from shared.control.arrow_schema import INPUTS, OUTPUTS, check_row, fields_of, shape_row, to_wire

# the continuous-batching guide's upload_and_convert call, verbatim
DOC_INPUT = ("/////7AAAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAIAAABUAAAABAAAAMT///8AAAECEAAAACQ"
             "AAAAEAAAAAAAAAAoAAABtYXhfdG9rZW5zAAAIAAwACAAHAAgAAAAAAAABQAAAABAAFAAIAAYABwAMAAAAEAAQAAAAAAABBRAAAAAcAAAA"
             "BAAAAAAAAAAGAAAAcHJvbXB0AAAEAAQABAAAAA==")
DOC_OUTPUT = ("/////8AAAAAQAAAAAAAKAAwABgAFAAgACgAAAAABBAAMAAAACAAIAAAABAAIAAAABAAAAAIAAABcAAAABAAAALz///8AAAECEAAAACw"
              "AAAAEAAAAAAAAABEAAABudW1fb3V0cHV0X3Rva2VucwAAAAgADAAIAAcACAAAAAAAAAFAAAAAEAAUAAgABgAHAAwAAAAQABAAAAAAAAEF"
              "EAAAACQAAAAEAAAAAAAAAA4AAABnZW5lcmF0ZWRfdGV4dAAABAAEAAQAAAA=")


def test_the_products_base64_schemas_are_read_as_its_pyarrow_schemas_say():
    inputs = fields_of("input_schema", DOC_INPUT, INPUTS)
    assert inputs == [("prompt", "string", True), ("max_tokens", "int64", True)]
    assert fields_of("output_schema", DOC_OUTPUT, OUTPUTS) == [("generated_text", "string", True),
                                                               ("num_output_tokens", "int64", True)]
    same = pa.schema([pa.field("prompt", pa.string()), pa.field("max_tokens", pa.int64())])
    assert fields_of("input_schema", to_wire(same), INPUTS) == inputs  # the SDK sends a pyarrow schema so
    assert fields_of("input_schema", to_wire(pa.schema([])), INPUTS) == []  # the OpenAI tutorials' empty one
    assert to_wire(DOC_INPUT) == DOC_INPUT and to_wire(None) is None


@pytest.mark.parametrize(("encoded", "message"), [
    ("not base64!", "input_schema is not a base64 Arrow schema"),
    (base64.b64encode(b"hello").decode(), "input_schema is not a base64 Arrow schema"),
    (to_wire(pa.schema([pa.field("image", pa.binary())])), "field 'image' is not one the records route has"),
    (to_wire(pa.schema([pa.field("prompt", pa.int64())])), "field 'prompt' is int64: allowed string, large_string"),
])
def test_a_schema_the_records_route_cannot_honour_is_refused(encoded, message):
    with pytest.raises(ConfigError, match=message):
        fields_of("input_schema", encoded, INPUTS)


def test_rows_are_checked_and_outputs_shaped():
    inputs = fields_of("input_schema", to_wire(pa.schema([pa.field("prompt", pa.string(), nullable=False),
                                                          pa.field("max_tokens", pa.int64())])), INPUTS)
    check_row(inputs, {"prompt": "hi", "max_tokens": 5}, 0)
    check_row(inputs, {"prompt": "hi"}, 0)  # max_tokens is nullable
    with pytest.raises(ValueError, match="row 1: column 'temperature' is not in the model's input_schema"):
        check_row(inputs, {"prompt": "hi", "temperature": 0.5}, 1)
    with pytest.raises(ValueError, match="row 0: 'max_tokens' must be int64, got str"):
        check_row(inputs, {"prompt": "hi", "max_tokens": "5"}, 0)
    with pytest.raises(ValueError, match="'prompt' is required"):
        check_row(inputs, {"prompt": None}, 0)
    check_row([], {"anything": 1}, 0)  # no schema, nothing checked
    outputs = fields_of("output_schema", to_wire(pa.schema([pa.field("num_output_tokens", pa.int64())])), OUTPUTS)
    assert shape_row(outputs, {"generated_text": "x", "num_output_tokens": 3}) == {"num_output_tokens": 3}
