"""A chat request's images in its prompt: each placeholder the chat template writes expanded into
the model's run of image tokens (as its processor does), the runs found in the token ids, and the
images fetched, checked, resized and stored for the workers before the request is submitted."""

from __future__ import annotations

import asyncio

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.media.fetch import MediaError, fetch
from services.api.media.images import decode, square_pixels
from services.api.off_loop import off_loop
from services.api.openai.protocol import ChatMessage
from shared.bus.media import MediaStore, image_key
from shared.wire.images import ImageRef, ImageSpec


def check_images(model: ServedModel, messages: list[ChatMessage], limit: int) -> int:
    """The request's image parts: at most `limit` (--limit-mm-per-prompt), and only to a model that
    takes them (its workers announce an ImageSpec): a 400 before anything is fetched. Returns their number."""
    count = sum(len(m.images()) for m in messages)
    if count > limit:
        raise APIError(400, f"At most {limit} image(s) may be provided in one prompt.", param="messages")  # vLLM's words
    if count and model.images is None:
        archs = ", ".join(model.architectures) or "a text-only model"
        raise APIError(400, f"The model {model.name!r} does not take image inputs ({archs}); send text only, "
                            "or serve an image-text model (docs/images.md)", param="messages")
    return count


async def store_images(ctx: ApiContext, model: ServedModel, messages: list[ChatMessage]) -> list[str]:
    """Each image part fetched, decoded, resized to the model's side and put in the media store, in
    prompt order: their keys. Any that cannot be used is a 400 naming the part and why."""
    urls = [image for m in messages for image in m.images()]
    if check_images(model, messages, ctx.server.limit_images) == 0:
        return []
    side = model.images.size

    async def one(i: int) -> str:
        try:
            picture = await off_loop(decode, await fetch(urls[i].url, ctx.server.media))
        except MediaError as exc:
            raise APIError(400, f"image {i}: {exc}", param="messages") from None
        key = image_key(picture.digest, side)
        await _media(ctx).put(key, await off_loop(square_pixels, picture, side))
        return key

    return list(await asyncio.gather(*(one(i) for i in range(len(urls)))))


def _media(ctx: ApiContext) -> MediaStore:
    if ctx.media is None:
        ctx.media = MediaStore(ctx.nc)
    return ctx.media


def expand_placeholders(text: str, model: ServedModel, count: int) -> str:
    """Each image's start token the template wrote becomes the model's whole run (Gemma 3's
    processor: "\\n\\n<start_of_image>" + the image tokens + "<end_of_image>\\n\\n")."""
    spec, tok = model.images, model.tokenizer
    start, end, image = tok.token_string(spec.start_id), tok.token_string(spec.end_id), tok.token_string(spec.token_id)
    if text.count(start) != count:
        raise APIError(400, f"the chat template placed {text.count(start)} image(s) where the request has {count}",
                       param="messages")
    return text.replace(start, f"\n\n{start}{image * spec.num_tokens}{end}\n\n") if count else text


def image_refs(ids: list[int], spec: ImageSpec | None, keys: list[str]) -> list[ImageRef]:
    """The image runs of the prompt's token ids, one per key, in order."""
    if not keys:
        return []
    starts = [i for i, t in enumerate(ids) if t == spec.token_id and (i == 0 or ids[i - 1] != spec.token_id)]
    refs = [ImageRef(key=key, offset=start, num_tokens=spec.num_tokens) for key, start in zip(keys, starts, strict=False)]
    if len(starts) != len(keys) or any(ids[r.offset:r.end] != [spec.token_id] * spec.num_tokens for r in refs):
        raise APIError(400, f"the prompt holds {len(starts)} whole image(s) of {spec.num_tokens} tokens where the "
                            f"request has {len(keys)} (a truncated prompt cuts one?)", param="messages")
    return refs
