"""A chat request's images in its prompt: each placeholder the chat template writes expanded into
the model's run of image tokens (as its processor does), the runs found in the token ids, and the
images fetched, checked, resized and stored for the workers before the request is submitted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.api.context import ApiContext, ServedModel
from services.api.errors import APIError
from services.api.media.fetch import MediaError, fetch
from services.api.media.images import decode, resized_pixels
from services.api.media.processor import pan_and_scan, processor_args
from services.api.off_loop import off_loop
from services.api.openai.protocol import ChatMessage
from shared.bus.media import MediaStore, image_key
from shared.wire.images import ImageRef, ImageSpec


@dataclass(frozen=True)
class PromptImage:
    key: str  # in the media store
    width: int  # the pixels it was resized to
    height: int
    num_tokens: int  # its image tokens in the prompt
    crop: bool = False  # one of pan and scan's crops of the image part before it (Gemma 3's)


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


async def store_images(ctx: ApiContext, model: ServedModel, messages: list[ChatMessage], kwargs: dict | None = None,
                       store: bool = True) -> list[PromptImage]:
    """Each image part fetched, decoded, resized to what the model reads (kwargs: the request's
    mm_processor_kwargs; pan and scan's crops after their image) and (store) put in the media store,
    in prompt order. Any that cannot be used is a 400 naming the part and why."""
    urls = [image for m in messages for image in m.images()]
    args = processor_args(model.images, ctx.server.mm_processor_kwargs, kwargs)  # checked with or without images
    if check_images(model, messages, ctx.server.limit_images) == 0:
        return []
    spec = args.spec

    async def one(i: int) -> list[PromptImage]:
        try:
            picture = await off_loop(decode, await fetch(urls[i].url, ctx.server.media))
            boxes = [None, *pan_and_scan(*picture.size, args)]
            sizes = [spec.resized(*(picture.size if b is None else (b[2] - b[0], b[3] - b[1]))) for b in boxes]
        except (MediaError, ValueError) as exc:
            raise APIError(400, f"image {i}: {exc}", param="messages") from None
        out = []
        for box, (width, height) in zip(boxes, sizes, strict=True):
            key = image_key(picture.digest if box is None else f"{picture.digest}@{','.join(map(str, box))}", width, height)
            if store:
                await _media(ctx).put(key, await off_loop(resized_pixels, picture, width, height, spec.resample, box))
            out.append(PromptImage(key, width, height, spec.tokens_for(width, height), crop=box is not None))
        return out

    return [image for part in await asyncio.gather(*(one(i) for i in range(len(urls)))) for image in part]


def _media(ctx: ApiContext) -> MediaStore:
    if ctx.media is None:
        ctx.media = MediaStore(ctx.nc)
    return ctx.media


def expand_placeholders(text: str, model: ServedModel, images: list[PromptImage]) -> str:
    """Each image part's placeholder the template wrote becomes the model's run of its image tokens,
    as its processor expands it: a start, one image token and an end (Qwen2.5-VL's template) -> the
    image token repeated as its size makes them; a start alone (Gemma 3's) -> "\n\n" + start + 256
    image tokens + end + "\n\n", and with pan and scan's crops, Gemma3Processor's sentence around
    the image's run and its crops'."""
    spec, tok = model.images, model.tokenizer
    start, end, image = tok.token_string(spec.start_id), tok.token_string(spec.end_id), tok.token_string(spec.token_id)
    parts: list[list[PromptImage]] = []  # each part's image, then its crops
    for item in images:
        if item.crop:
            parts[-1].append(item)
        else:
            parts.append([item])
    whole = start + image + end
    if text.count(whole) == len(parts) > 0:
        pieces, runs = text.split(whole), [f"{start}{image * p[0].num_tokens}{end}" for p in parts]
    elif text.count(start) == len(parts):
        def run(n: int) -> str:
            return f"\n\n{start}{image * n}{end}\n\n"
        pieces = text.split(start)
        runs = [run(p[0].num_tokens) if len(p) == 1 else
                f"Here is the original image {run(p[0].num_tokens)} and here are some crops to help you see better "
                + " ".join(run(c.num_tokens) for c in p[1:]) for p in parts]
    else:
        raise APIError(400, f"the chat template placed {text.count(start)} image(s) where the request has "
                            f"{len(parts)}", param="messages")
    return pieces[0] + "".join(r + piece for r, piece in zip(runs, pieces[1:], strict=True))


def image_refs(ids: list[int], spec: ImageSpec | None, images: list[PromptImage]) -> list[ImageRef]:
    """The image runs of the prompt's token ids, one per image, in order, each as long as its image's tokens."""
    if not images:
        return []
    runs: list[list[int]] = []  # [start, length] of each run of image tokens
    for i, t in enumerate(ids):
        if t == spec.token_id:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
    if len(runs) != len(images) or any(n != image.num_tokens for (_, n), image in zip(runs, images, strict=False)):
        raise APIError(400, f"the prompt holds {len(runs)} image run(s) of {[n for _, n in runs]} tokens where the "
                            f"request's images take {[i.num_tokens for i in images]} (a truncated prompt cuts one?)",
                       param="messages")
    return [ImageRef(key=image.key, offset=start, num_tokens=n, width=image.width, height=image.height)
            for (start, n), image in zip(runs, images, strict=True)]
