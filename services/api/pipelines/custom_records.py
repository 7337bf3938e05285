"""The records route for a custom model: rows checked against its schemas, predicted by its runtime
process (services/custom_runtime) over `sy.v1.custom.<deployment>.predict`."""

from __future__ import annotations

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from shared.control.arrow_schema import check_row, fields_of, shape_row
from shared.wire import subjects


async def custom_records(ctx: ApiContext, model: ServedModel, rows: list) -> list[dict]:
    version = model.deployed.version
    inputs = fields_of("input_schema", version.input_schema, None)
    outputs = fields_of("output_schema", version.output_schema, None)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise APIError(400, f"row {i}: a record is an object of columns")
        try:
            check_row(inputs, row, i)
        except ValueError as exc:
            raise APIError(400, str(exc), param="input_schema") from None
    try:
        msg = await ctx.nc.request(subjects.custom_predict(model.name), msgspec.json.encode({"rows": rows}),
                                   timeout=ctx.server.request_timeout_s or None)
    except NoRespondersError:
        raise APIError(503, f"the custom runtime of {model.name!r} is not running (yet)",
                       code="model_not_ready") from None
    except (TimeoutError, NatsTimeoutError):
        raise APIError(504, f"the custom runtime of {model.name!r} did not answer in {ctx.server.request_timeout_s:g}s",
                       code="timeout") from None
    reply = msgspec.json.decode(msg.data)
    if "error" in reply:
        raise APIError(500, f"the custom model's predict failed: {reply['error']}", code="predict_failed")
    try:
        return [shape_row(outputs, row) for row in reply["rows"]]
    except KeyError as exc:
        raise APIError(500, f"the custom model's predict left out {exc} of its output_schema",
                       code="predict_failed") from None
