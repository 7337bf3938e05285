"""LoRA adapters on the bus: the orders that load and unload one on a model's workers (API ->
scheduler -> each worker), and what a worker announces about the adapters it serves."""

from __future__ import annotations

from typing import Union

import msgspec


class LoraInfo(msgspec.Struct, array_like=True):
    """An adapter a worker serves: its name (a request's `model`), where it was read from, its rank,
    and a digest of its files (loaded again in place with other weights, it is another adapter to
    the prefix cache)."""

    name: str
    path: str
    rank: int
    digest: str = ""


class LoadLora(msgspec.Struct, tag="load_lora"):
    """vLLM's /v1/load_lora_adapter: read the PEFT directory at `path` and serve it as `name`."""

    name: str
    path: str
    load_inplace: bool = False  # vLLM's: an adapter of that name already served takes the new weights


class UnloadLora(msgspec.Struct, tag="unload_lora"):
    """vLLM's /v1/unload_lora_adapter: new requests are refused at once; the adapter's weights are
    let go once the requests already running on it have finished."""

    name: str


class LoraState(msgspec.Struct, tag="lora_state"):
    adapters: list[LoraInfo] = []  # what is served after the order
    error: str | None = None  # the order was refused (the adapter does not fit the model, ...): why
    not_found: bool = False  # the error is an adapter nobody serves (HTTP 404, not 400)


LoraOrder = Union[LoadLora, UnloadLora]
LORA_ORDER_DECODER = msgspec.msgpack.Decoder(LoraOrder)
LORA_STATE_DECODER = msgspec.msgpack.Decoder(LoraState)


def add_lora_args(parser) -> None:
    """vLLM's LoRA flags, for the worker (the launcher passes them to every service)."""
    parser.add_argument("--enable-lora", action="store_true", default=False,
                        help="serve LoRA adapters over the base model (implied by --lora-modules); adapters "
                             "load at start and at run time (POST /v1/load_lora_adapter)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT LoRA adapters served from start, each as NAME=PATH (a request's model NAME)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters one step may mix (each a slot)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank a slot takes")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept in host memory (default: --max-loras); others are read again when used")


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """['name=path', ...] -> {name: path}; ValueError naming a malformed entry."""
    modules = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {value!r}")
        modules[name] = path
    return modules


def peft_lora_rank(folder: str) -> int:
    """The rank of the PEFT LoRA adapter in `folder` (an upload's first check; the worker checks the
    rest against its model); ValueError saying what is missing."""
    import json
    from pathlib import Path

    config, weights = Path(folder) / "adapter_config.json", Path(folder) / "adapter_model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise ValueError("a LoRA adapter is PEFT's directory: adapter_config.json and adapter_model.safetensors")
    try:
        raw = json.loads(config.read_text())
        rank = int(raw["r"])
    except Exception as exc:
        raise ValueError(f"adapter_config.json cannot be read ({type(exc).__name__}: {exc})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {raw['peft_type']!r} is not LoRA")
    return rank
