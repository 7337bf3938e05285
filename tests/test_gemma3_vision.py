"""Gemma 3 with images (Gemma3ForConditionalGeneration), against transformers: random weights saved by
transformers for a shrunk config (say so: 2 layers, one sliding, 16x16 images of 4 tokens), the
image encoder's features, and the language model's logits over image and text positions with the
image tokens' two-way attention, in one prefill, in chunks, and through decode steps."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from shared.wire.images import ImageRef
from shared.wire.messages import NewSeq, SamplingParams, Step
from tests.image_checkpoints import (
    GEMMA3_BOI,
    GEMMA3_EOI,
    GEMMA3_IMAGE,
    GEMMA3_TOKENS_PER_IMAGE,
    gemma3_vision,
)
from tests.model_helpers import BLOCK_SIZE, chunked_logits, cuda_image_runner, greedy_with_images, make_runner

transformers = pytest.importorskip("transformers")
IMAGE_TOKEN, BOI, EOI, TOKENS_PER_IMAGE = GEMMA3_IMAGE, GEMMA3_BOI, GEMMA3_EOI, GEMMA3_TOKENS_PER_IMAGE
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vision")
    return gemma3_vision(folder), str(folder)


def _prompt() -> tuple[list[int], list[tuple[int, int]]]:
    """Text, an image, text, a second image, text (as Gemma 3's processor lays out its tokens), and
    the images' [start, end) positions."""
    ids, spans = [2, 10, 11, 12], []
    for text in ([20, 21, 22], [30, 31]):
        ids.append(BOI)
        spans.append((len(ids), len(ids) + TOKENS_PER_IMAGE))
        ids += [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI] + text
    return ids, spans


def _reference_logits(model, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=pixels, token_type_ids=(input_ids == IMAGE_TOKEN).long()).logits[0]


def _images(runner, spans: list[tuple[int, int]]) -> tuple[list[ImageRef], torch.Tensor]:
    """Random 16x16 pictures put where a worker puts what it reads from the media store: their refs,
    and the pixels Gemma 3's processor would give transformers ((x / 255 - 0.5) / 0.5)."""
    raw = torch.randint(0, 256, (len(spans), 16, 16, 3), dtype=torch.uint8)
    refs = [ImageRef(key=f"img{i}", offset=begin, num_tokens=end - begin) for i, (begin, end) in enumerate(spans)]
    for ref, picture in zip(refs, raw, strict=True):
        runner.add_image(ref, picture.numpy().tobytes())
    return refs, (raw.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def test_the_image_encoder_gives_transformers_features(checkpoint):
    model, folder = checkpoint
    ours = load_model(folder, ops=TORCH_OPS).model
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output
        got = ours.vision(pixels)  # encode() normalizes uint8 pixels first: the tower itself here
    assert got.shape == (3, TOKENS_PER_IMAGE, 64)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunks", [[None], [4, None], [10, 9, None]], ids=["one-prefill", "two-chunks", "three-chunks"])
def test_logits_over_image_and_text_positions_match_transformers(checkpoint, chunks):
    """Chunks split between the images, never inside one (the scheduler's rule): the later chunks
    see the earlier ones' image keys through the cache."""
    model, folder = checkpoint
    runner = make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16)
    ids, spans = _prompt()
    refs, pixels = _images(runner, spans)
    expected = _reference_logits(model, ids, pixels)
    got = chunked_logits(runner, ids, refs, chunks, list(range((len(ids) + 8 + BLOCK_SIZE - 1) // BLOCK_SIZE)))
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)
    assert runner.backend.images.num_encoded == 2  # each image once, though three chunks read them


def test_decode_steps_after_the_images_match_transformers(checkpoint):
    model, folder = checkpoint
    runner = make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16)
    ids, spans = _prompt()
    refs, pixels = _images(runner, spans)
    tokens, logits = greedy_with_images(runner, ids, refs, None, [0, 1], 4)
    for step, step_logits_ in enumerate(logits):
        expected = _reference_logits(model, tokens[:len(ids) + step], pixels)[-1]
        assert torch.allclose(step_logits_[-1], expected, atol=TOLERANCE, rtol=0)


def test_a_new_sequence_whose_image_is_not_there_fails_alone(checkpoint):
    runner = make_runner(load_model(checkpoint[1], ops=TORCH_OPS), num_blocks=16)
    ids, spans = _prompt()
    refs, _ = _images(runner, spans[:1])
    gone = [refs[0], ImageRef(key="expired", offset=spans[1][0], num_tokens=TOKENS_PER_IMAGE)]
    plain = [5, 6, 7]
    out = runner.execute(Step(step_id=0, new_seqs=[
        NewSeq(request_id="gone", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0,
               num_new_tokens=len(ids), block_ids=[0, 1], sampling=SamplingParams(max_tokens=2), reply_to="",
               images=gone),
        NewSeq(request_id="text", token_ids=plain, num_prompt_tokens=3, num_computed_tokens=0, num_new_tokens=3,
               block_ids=[2], sampling=SamplingParams(max_tokens=2, temperature=0.0), reply_to="")]))
    by_id = {s.request_id: s for s in out.sampled}
    assert by_id["gone"].error == "image expired is not in the media store (expired, or never stored)"
    assert by_id["text"].token_id >= 0 and by_id["text"].error is None


def test_the_qaic_backend_refuses_an_image_text_model_by_name(checkpoint):
    from services.worker.backends.qaic.backend import QaicBackend
    from services.worker.backends.spec import WorkerSpec
    from shared.config import ConfigError

    spec = WorkerSpec(model_path=checkpoint[1], load_format="auto", kv_cache_bytes=lambda _: 0)
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration is an image-text model, which the qaic "
                                          "backend does not serve: its vision tower would be a second compiled program"):
        QaicBackend.create(spec.with_dtype_for("qaic"), device="cpu")


@pytest.mark.slow  # Triton interpreted on the CPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/gpu/ runs the real thing")
def test_the_cuda_backends_image_path_gives_the_torch_backends_logits(checkpoint):
    """The CUDA backend (Triton kernels interpreted, float32) with both images: the prefill kernel
    lets an image's tokens see each other both ways, in the sliding layer too; then decode steps."""
    folder = checkpoint[1]
    ids, spans = _prompt()
    raw = torch.randint(0, 256, (len(spans), 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    refs = [ImageRef(key=f"img{i}", offset=begin, num_tokens=end - begin) for i, (begin, end) in enumerate(spans)]
    pixels = [picture.numpy().tobytes() for picture in raw]
    cuda = cuda_image_runner(folder)
    want_tokens, want = greedy_with_images(make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16), ids, refs,
                                           pixels, [0, 1], 3)
    got_tokens, got = greedy_with_images(cuda, ids, refs, pixels, [0, 1], 3)
    assert got_tokens == want_tokens
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0)
    assert cuda.backend.images.num_encoded == 2
