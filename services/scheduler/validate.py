"""Every Submit is checked before it is admitted: the bus is a public API, not only the gateway's."""

from __future__ import annotations

import math

from shared.wire.images import ImageRef, ImageSpec
from shared.wire.messages import SamplingParams, Submit

MAX_TOKEN_LIST = 65_536  # stop_token_ids, allowed_token_ids, logit_bias entries
INT64_MAX = 2**63 - 1


def submit_error(submit: Submit, vocab_size: int) -> str | None:
    """Why the scheduler must refuse this Submit, or None. vocab_size: the model's logits width
    (0 while unknown: token ids are then only checked to be non-negative)."""
    if not submit.request_id or len(submit.request_id) > 256:
        return "request_id must be 1 to 256 characters"
    if not submit.prompt_token_ids:
        return "the prompt is empty"
    if (bad := _bad_token_id(submit.prompt_token_ids, vocab_size)) is not None:
        return f"prompt_token_ids: {bad}"
    if (bad := _bad_token_id(submit.resume_token_ids, vocab_size)) is not None:
        return f"resume_token_ids: {bad}"
    if submit.resume_token_ids and len(submit.resume_token_ids) >= submit.sampling.max_tokens:
        return f"resume_token_ids: {len(submit.resume_token_ids)} tokens leave none of max_tokens to go"
    if not submit.reply_to or any(c in submit.reply_to for c in " \t\r\n*>"):
        return f"reply_to must be one concrete NATS subject, got {submit.reply_to!r}"
    if not -(2**31) <= submit.priority < 2**31:
        return f"priority must fit in 32 bits, got {submit.priority}"
    for name, value in (("arrival_time", submit.arrival_time), ("deadline", submit.deadline)):
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value}"
    return sampling_error(submit.sampling, vocab_size)


def images_error(submit: Submit, spec: ImageSpec | None, max_num_batched_tokens: int) -> str | None:
    """A Submit's images: only to a model that takes them, each a run of its image tokens inside
    the prompt, in order, and small enough for one step (an image is computed in one forward)."""
    if not submit.images:
        return None
    if spec is None:
        return "images: this model takes no images"
    prompt, end = submit.prompt_token_ids, 0
    for i, image in enumerate(submit.images):
        if not 0 < len(image.key) <= 256:
            return f"images[{i}].key must be 1 to 256 characters"
        if (why := _size_error(image, spec)) is not None:
            return f"images[{i}]: {why}"
        if image.offset < end or image.end > len(prompt):
            return (f"images[{i}] must be a run of {image.num_tokens} tokens inside the prompt, after the image "
                    f"before it, got [{image.offset}, {image.end})")
        if any(t != spec.token_id for t in prompt[image.offset:image.end]):
            return f"images[{i}]: the prompt's tokens [{image.offset}, {image.end}) are not all image tokens ({spec.token_id})"
        if image.num_tokens > max_num_batched_tokens:
            return (f"images[{i}] takes {image.num_tokens} tokens, more than one step computes "
                    f"(max_num_batched_tokens {max_num_batched_tokens})")
        end = image.end
    return None


def _size_error(image: ImageRef, spec: ImageSpec) -> str | None:
    """An image's size and tokens as the model reads them: its square, or its own size in whole
    patches."""
    if not spec.dynamic:
        if image.num_tokens != spec.num_tokens or (image.width, image.height) not in ((0, 0), (spec.size, spec.size)):
            return f"must be {spec.size}x{spec.size} pixels of {spec.num_tokens} tokens"
        return None
    w, h = image.width, image.height
    if w <= 0 or h <= 0 or w % spec.patch or h % spec.patch:  # its area: as the request's mm_processor_kwargs asked
        return f"{w}x{h} pixels: the sides must be multiples of {spec.patch}"
    if image.num_tokens != spec.tokens_for(w, h):
        return f"{w}x{h} pixels take {spec.tokens_for(w, h)} tokens, not {image.num_tokens}"
    return None


def sampling_error(p: SamplingParams, vocab_size: int) -> str | None:
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be at least 1, got {p.max_tokens}"),
        (0 <= p.min_tokens <= p.max_tokens, f"min_tokens must be in [0, max_tokens], got {p.min_tokens}"),
        (math.isfinite(p.temperature) and p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (0 <= p.top_k <= INT64_MAX, f"top_k must be >= 0 (0: every token), got {p.top_k}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (-2 <= p.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2 <= p.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (0 < p.repetition_penalty <= 2**31 and math.isfinite(p.repetition_penalty),
         f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (p.seed is None or -INT64_MAX - 1 <= p.seed <= INT64_MAX, f"seed must fit in 64 bits, got {p.seed}"),
    ]
    most = vocab_size or MAX_TOKEN_LIST  # alternatives per position: at most the whole vocabulary
    for name, value in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        checks.append((value is None or 0 <= value <= most, f"{name} must be in [0, {most}], got {value}"))
    for ok, why in checks:
        if not ok:
            return why
    for name, ids in (("stop_token_ids", p.stop_token_ids), ("allowed_token_ids", p.allowed_token_ids),
                      ("logit_bias", list(p.logit_bias))):
        if len(ids) > MAX_TOKEN_LIST:
            return f"{name} may hold at most {MAX_TOKEN_LIST} entries, got {len(ids)}"
        if (bad := _bad_token_id(ids, vocab_size)) is not None:
            return f"{name}: {bad}"
    if not all(math.isfinite(v) and -100 <= v <= 100 for v in p.logit_bias.values()):
        return "logit_bias values must be in [-100, 100]"
    return None


def _bad_token_id(ids: list[int], vocab_size: int) -> str | None:
    """min/max in C: a long prompt costs microseconds here, not a Python loop per token."""
    limit = vocab_size or INT64_MAX + 1
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(t for t in ids if not 0 <= t < limit)
        return f"token id {bad} is outside the vocabulary [0, {limit})"
    return None
