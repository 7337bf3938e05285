"""vLLM's kv_transfer_params, with which an outside router drives disaggregated prefill: the prefill
request's answer says where its prompt's blocks wait; the decode request carries that back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.api.errors import APIError
from shared.log import get_logger
from shared.wire.kv_events import KvTransferParams

if TYPE_CHECKING:
    from services.api.openai.choices import Choices
    from services.api.openai.protocol import _Sampling

log = get_logger("api.kv_transfer")
_OURS = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_engine_id": str, "remote_request_id": str,
         "remote_block_ids": list, "prompt_token_ids": list}
# vLLM's NIXL side channel: our answers carry null and 1; another engine's values are refused
_INFORMATIONAL = {"remote_host": None, "remote_port": None, "tp_size": 1}
_PARAM = "kv_transfer_params"


def transfer_params(body: _Sampling) -> KvTransferParams | None:
    """The request's kv_transfer_params, checked (a 400 names what is wrong); None without them."""
    raw = body.kv_transfer_params
    if raw is None:
        return None
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _INFORMATIONAL and value not in (None, _INFORMATIONAL[key]):
            raise APIError(400, f"kv_transfer_params: {key} {value!r} names another engine's side channel (vLLM's "
                                "NIXL); blocks here are read through the deployment's bus, named by "
                                "remote_engine_id and remote_request_id", param=_PARAM)
        if key in _INFORMATIONAL or key == "prompt_token_ids" or value is None:
            continue  # prompt_token_ids: the chat route's (reused_prompt_ids)
        kind = _OURS.get(key)
        if kind is None:
            raise APIError(400, f"kv_transfer_params: unknown key {key!r} (served: "
                                f"{', '.join(sorted(_OURS | dict.fromkeys(_INFORMATIONAL)))})", param=_PARAM)
        if not isinstance(value, kind) or (kind is list and not all(isinstance(i, int) for i in value)):
            raise APIError(400, f"kv_transfer_params: {key} must be {'a list of integers' if kind is list else kind.__name__}",
                           param=_PARAM)
        fields[key] = value
    params = KvTransferParams(**fields)
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None  # a decode's prompt_token_ids alone (reused_prompt_ids), or vLLM's keys all unset
    if body.n != 1 or body.use_beam_search:
        raise APIError(400, "kv_transfer_params are served for one choice a request (n 1, no beam search)",
                       param=_PARAM)
    if params.do_remote_prefill and not params.remote_request_id:
        raise APIError(400, "kv_transfer_params: do_remote_prefill needs the prefill answer's remote_request_id",
                       param=_PARAM)
    return params


def reused_prompt_ids(body: _Sampling, has_images: bool) -> list[int] | None:
    """vLLM's decode-side token reuse: a router forwards the prefill's prompt ids in
    kv_transfer_params["prompt_token_ids"], and a chat request runs them as they are instead of
    rendering its messages; except with echo or images, which need the messages (vLLM's rule)."""
    ids = (body.kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None or getattr(body, "echo", False) or has_images:
        return None
    if not isinstance(ids, list) or not ids or any(type(i) is not int or i < 0 for i in ids):
        raise APIError(400, "kv_transfer_params: prompt_token_ids must be a non-empty list of non-negative integers",
                       param=_PARAM)
    return ids


def check_one_choice(body: _Sampling, choices: Choices) -> None:
    """Beam search makes its engine requests later: its params are checked here too."""
    params = transfer_params(body)
    if (body.kv_transfer_params or {}).get("prompt_token_ids") is not None and not hasattr(body, "messages"):
        raise APIError(400, "kv_transfer_params: prompt_token_ids are a chat request's (a completion's prompt "
                            "takes token ids itself)", param=_PARAM)
    if params is not None and choices.num_choices != 1:
        raise APIError(400, "kv_transfer_params are served for one prompt a request", param=_PARAM)


async def answer_params(choices: Choices) -> dict[str, Any] | None:
    """A prefill request's answer (vLLM's shape; a stream's on its last choice chunk): where its
    prompt's blocks wait for the decode request, when it ended at its length (as vLLM's connectors
    answer); None otherwise."""
    gen = choices.generations[0]
    params = getattr(gen, "kv_transfer", None)
    if params is None or not params.do_remote_decode or gen.finish_reason != "length":
        return None
    held = await gen.bus.kv_held(gen.model, gen.stream.request_id)
    if held.error is not None or not held.slots:
        log.warning("kv_transfer_params_none", request_id=gen.stream.request_id, error=held.error)
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": held.tier_id,
            "remote_block_ids": held.slots, "remote_request_id": gen.stream.request_id,
            "remote_host": None, "remote_port": None, "tp_size": 1}
