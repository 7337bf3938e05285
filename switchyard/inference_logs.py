"""A pipeline's inference log records as the pandas DataFrame `pipeline.logs()` returns."""

from __future__ import annotations

from datetime import datetime

IN_FIELDS = ("prompt", "messages")
OUT_FIELDS = {"output": "generated_text", "finish_reason": "finish_reason", "num_output_tokens": "num_output_tokens"}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def inference_log_frame(records: list[dict]):
    """One row per record: `time` (UTC), `in.*` (what was sent), `out.*` (what came back) and
    `metadata.*` (log_id, model and version, route, token counts, timings, sampling and seed)."""
    import pandas as pd

    rows = []
    for r in records:
        row = {"time": pd.Timestamp(r["time"], unit="s", tz="UTC").floor("us")}  # a datetime's precision
        row.update({f"in.{k}": r["input"][k] for k in IN_FIELDS if k in r["input"]})
        row.update({f"out.{name}": r[key] for key, name in OUT_FIELDS.items()})
        row.update({f"metadata.{k}": r[k] for k in ("log_id", "model", "model_version", "route",
                                                    "num_prompt_tokens", "num_cached_tokens", "ttft_s", "e2e_s")})
        row.update({f"metadata.{k}": r["sampling"].get(k) for k in SAMPLING_FIELDS})
        row["metadata.stop"] = r.get("stop", [])
        row["metadata.truncated"] = r.get("truncated", False)
        rows.append(row)
    columns = ["time", *(f"in.{k}" for k in IN_FIELDS), *(f"out.{v}" for v in OUT_FIELDS.values())]
    frame = pd.DataFrame(rows)
    return frame if rows else pd.DataFrame(columns=columns)


def unix_seconds(value) -> float | None:
    """A datetime (naive ones are local time, as Python takes them) or Unix seconds."""
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, datetime):
        return value.timestamp()
    raise TypeError(f"a datetime or Unix seconds is required, got {type(value).__name__}")


def either(value, product_name_value, name: str):
    """`start` or the product's `start_datetime`, not both."""
    if value is not None and product_name_value is not None:
        raise TypeError(f"logs() got both {name} and {name}_datetime")
    return value if value is not None else product_name_value
