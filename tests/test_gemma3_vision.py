"""Gemma 3 with images (Gemma3ForConditionalGeneration), against transformers: random weights saved by
transformers for a shrunk config (say so: 2 layers, one sliding, 16x16 images of 4 tokens), the
image encoder's features, and the language model's logits over image and text positions with the
image tokens' two-way attention, in one prefill, in chunks, and through decode steps."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step
from tests.model_helpers import BLOCK_SIZE, make_runner

transformers = pytest.importorskip("transformers")
IMAGE_TOKEN, BOI, EOI = 299, 297, 298
TOKENS_PER_IMAGE = 4
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=4, image_size=16, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE_TOKEN, boi_token_index=BOI,
        eoi_token_index=EOI)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("gemma3-vision")
    model.save_pretrained(folder)
    return model, str(folder)


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


def _run_chunk(runner, step: Step, spans: list[tuple[int, int]], features: torch.Tensor, start: int, num: int):
    """One step of our model over positions [start, start + num), with the images' features at their
    tokens and their spans two-way (what the backend sets from a sequence's images)."""
    backend = runner.backend
    batch = runner.apply_deltas(step)
    inputs = backend.prepare(batch)
    rows = [p - start for begin, end in spans for p in range(begin, end) if start <= p < start + num]
    feats = [features[i, p - begin] for i, (begin, end) in enumerate(spans) for p in range(begin, end)
             if start <= p < start + num]
    inputs.meta.bidirectional = {0: [s for s in spans if s[0] < start + num and s[1] > start]}
    backend.model.image_embeds = (torch.tensor(rows, dtype=torch.long), torch.stack(feats)) if rows else None
    with torch.inference_mode():
        logits = backend.compute_logits(backend.forward(inputs))
    backend.model.image_embeds = None
    return logits


def test_the_image_encoder_gives_transformers_features(checkpoint):
    model, folder = checkpoint
    ours = load_model(folder, ops=TORCH_OPS).model
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output
        got = ours.vision(pixels)
    assert got.shape == (3, TOKENS_PER_IMAGE, 64)
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunks", [[None], [4, None], [10, 9, None]], ids=["one-prefill", "two-chunks", "three-chunks"])
def test_logits_over_image_and_text_positions_match_transformers(checkpoint, chunks):
    """Chunks split between the images, never inside one (the scheduler's rule): the later chunks
    see the earlier ones' image keys through the cache."""
    model, folder = checkpoint
    loaded = load_model(folder, ops=TORCH_OPS)
    runner = make_runner(loaded, num_blocks=16)
    ids, spans = _prompt()
    pixels = torch.randn(len(spans), 3, 16, 16)
    expected = _reference_logits(model, ids, pixels)
    with torch.no_grad():
        features = loaded.model.vision(pixels)
    blocks = list(range((len(ids) + 8 + BLOCK_SIZE - 1) // BLOCK_SIZE))
    got, start = [], 0
    for i, size in enumerate(chunks):
        num = (size or len(ids) - start)
        if i == 0:
            step = Step(step_id=0, new_seqs=[NewSeq(
                request_id="r", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0, num_new_tokens=num,
                block_ids=blocks, sampling=SamplingParams(max_tokens=8, temperature=0.0), reply_to="")])
        else:
            step = Step(step_id=i, scheduled=[ScheduledSeq(request_id="r", num_new_tokens=num, num_computed_tokens=start)])
        assert not any(begin < start + num < end for begin, end in spans)
        got.append(_run_chunk(runner, step, spans, features, start, num))
        runner.seqs["r"].num_computed_tokens = start + num
        start += num
    assert torch.allclose(torch.cat(got), expected, atol=TOLERANCE, rtol=0)


def test_decode_steps_after_the_images_match_transformers(checkpoint):
    model, folder = checkpoint
    loaded = load_model(folder, ops=TORCH_OPS)
    runner = make_runner(loaded, num_blocks=16)
    ids, spans = _prompt()
    pixels = torch.randn(len(spans), 3, 16, 16)
    with torch.no_grad():
        features = loaded.model.vision(pixels)
    step = Step(step_id=0, new_seqs=[NewSeq(
        request_id="r", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0, num_new_tokens=len(ids),
        block_ids=[0, 1], sampling=SamplingParams(max_tokens=8, temperature=0.0), reply_to="")])
    logits = _run_chunk(runner, step, spans, features, 0, len(ids))[-1]
    tokens = list(ids)
    for _ in range(4):
        tokens.append(int(logits.argmax()))
        expected = _reference_logits(model, tokens, pixels)[-1]
        assert torch.allclose(logits, _reference_logits(model, tokens[:-1], pixels)[-1], atol=TOLERANCE, rtol=0)
        seq = runner.seqs["r"]
        seq.num_computed_tokens = len(tokens) - 1
        seq.token_ids.append(tokens[-1])
        logits = _run_chunk(runner, Step(step_id=len(tokens), scheduled=[
            ScheduledSeq(request_id="r", num_new_tokens=1, num_computed_tokens=len(tokens) - 1)]), [], features, 0, 0)[-1]
        assert torch.allclose(logits, expected, atol=TOLERANCE, rtol=0)


def test_the_qaic_backend_refuses_an_image_text_model_by_name(checkpoint):
    from services.worker.backends.qaic.backend import QaicBackend
    from services.worker.backends.spec import WorkerSpec
    from shared.config import ConfigError

    spec = WorkerSpec(model_path=checkpoint[1], load_format="auto", kv_cache_bytes=lambda _: 0)
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration is an image-text model, which the qaic "
                                          "backend does not serve: its vision tower would be a second compiled program"):
        QaicBackend.create(spec.with_dtype_for("qaic"), device="cpu")
