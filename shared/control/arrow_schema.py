"""A model's Arrow schemas (the product's input_schema / output_schema): base64 of the schema's IPC
message on the wire and in the registry, checked against what the records route reads and writes.

The records route reads `prompt` (string) and `max_tokens` (an integer) and writes
`generated_text` (string) and `num_output_tokens` (an integer). A schema may name any of those,
with those types; a field it cannot fill or read is refused at upload or configure, so nothing
is accepted and ignored. An empty schema (the OpenAI tutorials' `pa.schema([])`) checks nothing.
"""

from __future__ import annotations

import base64
import binascii

from shared.config import ConfigError

# what the records route takes and gives: field -> the Arrow type families it accepts
INPUTS = {"prompt": ("string", "large_string"), "max_tokens": ("int8", "int16", "int32", "int64", "uint8",
                                                                "uint16", "uint32", "uint64")}
OUTPUTS = {"generated_text": INPUTS["prompt"], "num_output_tokens": INPUTS["max_tokens"]}
PY_TYPES = {"string": str, "large_string": str, "bool": bool, "halffloat": (int, float), "float": (int, float),
            "double": (int, float)}  # every other accepted type is an integer
# a custom model's columns are its own: any name, any of these types
ANY_TYPES = (*INPUTS["prompt"], *INPUTS["max_tokens"], "bool", "halffloat", "float", "double")


def to_wire(schema) -> str | None:
    """A pyarrow Schema (or its base64 already) -> base64 of its IPC message."""
    if schema is None or isinstance(schema, str):
        return schema
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def fields_of(field: str, encoded: str | None,
              allowed: dict[str, tuple[str, ...]] | None) -> list[tuple[str, str, bool]]:
    """[(name, arrow type, nullable)] of a base64 schema, each checked against `allowed` (None: a
    custom model's, any name of ANY_TYPES)."""
    if encoded is None:
        return []
    import pyarrow as pa

    try:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(encoded, validate=True)))
    except (binascii.Error, ValueError, TypeError, pa.ArrowException) as exc:
        raise ConfigError(f"{field} is not a base64 Arrow schema: {exc}") from None
    out = []
    for f in schema:
        if allowed is not None and f.name not in allowed:
            raise ConfigError(f"{field} field {f.name!r} is not one the records route has: "
                              f"{', '.join(allowed)}")
        types = ANY_TYPES if allowed is None else allowed[f.name]
        if str(f.type) not in types:
            raise ConfigError(f"{field} field {f.name!r} is {f.type}: allowed {', '.join(types)}")
        out.append((f.name, str(f.type), f.nullable))
    return out


def check_row(fields: list[tuple[str, str, bool]], row: dict, index: int) -> None:
    """A records-route row against the model's input schema (none: nothing to check)."""
    if not fields:
        return
    names = {name for name, _, _ in fields}
    for key in row:
        if key not in names:
            raise ValueError(f"row {index}: column {key!r} is not in the model's input_schema ({', '.join(names)})")
    for name, arrow_type, nullable in fields:
        value = row.get(name)
        if value is None:
            if not nullable:
                raise ValueError(f"row {index}: {name!r} is required by the model's input_schema")
            continue
        expected = PY_TYPES.get(arrow_type, int)
        if not isinstance(value, expected) or (isinstance(value, bool) and arrow_type != "bool"):
            raise ValueError(f"row {index}: {name!r} must be {arrow_type}, got {type(value).__name__}")


def shape_row(fields: list[tuple[str, str, bool]], row: dict) -> dict:
    """The records route's output row with the output schema's fields, in its order (none: as is)."""
    return {name: row[name] for name, _, _ in fields} if fields else row
