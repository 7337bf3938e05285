"""Qwen2.5-VL with images (Qwen2_5_VLForConditionalGeneration), against transformers: random weights
saved by transformers for a shrunk config (say so: 2 language layers, a 2-layer vision tower of
4-pixel patches, 16-pixel windows, images of 15 and 16 tokens), transformers' own image processor
for its pixels; the encoder's features alone and batched, and the logits over image and text
positions with M-RoPE, in one prefill, in chunks and through decode steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from shared.wire.images import ImageRef
from shared.wire.messages import NewSeq, SamplingParams, Step
from tests.image_checkpoints import QWEN_END, QWEN_IMAGE, QWEN_START, qwen25vl
from tests.model_helpers import (
    BLOCK_SIZE,
    chunked_logits,
    cuda_image_runner,
    greedy_with_images,
    make_runner,
    step_logits,
)

transformers = pytest.importorskip("transformers")
IMAGE, START, END = QWEN_IMAGE, QWEN_START, QWEN_END
SIZES = [(40, 24), (16, 64)]  # (width, height): 5x3 and 2x8 tokens of 8x8 pixels
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen25vl")
    model, processor = qwen25vl(folder)
    return model, str(folder), processor


def _pictures(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in SIZES]


def _processed(processor, pictures):
    from PIL import Image
    return processor([Image.fromarray(p) for p in pictures], return_tensors="pt")


def _prompt() -> tuple[list[int], list[ImageRef]]:
    """Text, an image, text, a second image, text, as Qwen2.5-VL's processor lays out its tokens."""
    ids, refs = [5, 10, 11, 12], []
    for i, ((w, h), text) in enumerate(zip(SIZES, ([20, 21, 22], [30, 31]), strict=True)):
        n = (w // 8) * (h // 8)
        ids.append(START)
        refs.append(ImageRef(key=f"img{i}", offset=len(ids), num_tokens=n, width=w, height=h))
        ids += [IMAGE] * n + [END] + text
    return ids, refs


def _reference_logits(model, processor, ids: list[int], pictures) -> torch.Tensor:
    inputs = _processed(processor, pictures)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(input_ids == IMAGE).int()).logits[0]


def _add(runner, refs, pictures) -> None:
    for ref, picture in zip(refs, pictures, strict=True):
        runner.add_image(ref, picture.tobytes())


def test_the_image_encoder_gives_transformers_features_alone_and_batched(checkpoint):
    model, folder, processor = checkpoint
    ours = load_model(folder, ops=TORCH_OPS).model
    pictures = _pictures()
    inputs = _processed(processor, pictures)
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).pooler_output
        batched = ours.vision.encode([torch.from_numpy(p) for p in pictures])
        alone = [ours.vision.encode([torch.from_numpy(p)])[0] for p in pictures]
    assert [f.shape for f in batched] == [(15, 64), (16, 64)]
    for want, got, one in zip(expected, batched, alone, strict=True):
        assert torch.allclose(got, want, atol=TOLERANCE, rtol=0)
        assert torch.allclose(one, got, atol=1e-5, rtol=0)


def test_the_processor_settings_come_from_preprocessor_config(checkpoint):
    from services.worker.images import image_spec
    config = load_model(checkpoint[1], ops=TORCH_OPS).config
    spec = image_spec(config.vision)
    assert (spec.patch, spec.min_pixels, spec.max_pixels, spec.resample) == (8, 64, 64 * 64, "bicubic")
    assert config.mrope_section == [2, 3, 3]


@pytest.mark.parametrize("chunks", [[None], [4, None], [22, 19, None]], ids=["one-prefill", "two-chunks", "three-chunks"])
def test_logits_over_image_and_text_positions_match_transformers(checkpoint, chunks):
    """M-RoPE's positions: the text after each image continues past its longer side, in every chunk."""
    model, folder, processor = checkpoint
    runner = make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16)
    ids, refs = _prompt()
    pictures = _pictures()
    _add(runner, refs, pictures)
    expected = _reference_logits(model, processor, ids, pictures)
    got = chunked_logits(runner, ids, refs, chunks, list(range((len(ids) + 8 + BLOCK_SIZE - 1) // BLOCK_SIZE)))
    assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)
    assert runner.backend.images.num_encoded == 2


def test_decode_steps_after_the_images_match_transformers(checkpoint):
    """Each decode token's three positions are its index plus the images' shift (transformers' rope deltas)."""
    model, folder, processor = checkpoint
    runner = make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16)
    ids, refs = _prompt()
    pictures = _pictures(1)
    tokens, logits = greedy_with_images(runner, ids, refs, [p.tobytes() for p in pictures], [0, 1, 2, 3], 4)
    for step, step_logits_ in enumerate(logits):
        expected = _reference_logits(model, processor, tokens[:len(ids) + step], pictures)[-1]
        assert torch.allclose(step_logits_[-1], expected, atol=TOLERANCE, rtol=0)


def test_text_only_matches_transformers(checkpoint):
    model, folder, _ = checkpoint
    runner = make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16)
    ids = [5, 10, 11, 12, 40, 41, 42]
    step = Step(step_id=0, new_seqs=[NewSeq(
        request_id="t", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0, num_new_tokens=len(ids),
        block_ids=[0], sampling=SamplingParams(max_tokens=2, temperature=0.0), reply_to="")])
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(step_logits(runner, step), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.slow  # Triton interpreted on the CPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/gpu/ runs the real thing")
def test_the_cuda_backends_image_path_gives_the_torch_backends_logits(checkpoint):
    """The CUDA backend (Triton kernels interpreted, float32) with both images: the prefill's logits,
    then decode steps (text alone: one position per row, shifted, as a CUDA graph takes them)."""
    folder = checkpoint[1]
    ids, refs = _prompt()
    pixels = [p.tobytes() for p in _pictures(2)]
    cuda = cuda_image_runner(folder)
    want_tokens, want = greedy_with_images(make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16), ids, refs,
                                           pixels, [0, 1, 2, 3], 3)
    got_tokens, got = greedy_with_images(cuda, ids, refs, pixels, [0, 1, 2, 3], 3)
    assert got_tokens == want_tokens
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0)
    assert cuda.backend.images.num_encoded == 2 and cuda.backend.images.spec.dynamic  # its workers announce images


# Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json as the Hub has them
# (transformers 4's flat layout: the language model's fields at the top, M-RoPE in rope_scaling)
HUB_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}
HUB_PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                 "processor_class": "Qwen2_5_VLProcessor"}


def test_the_hubs_config_reads_as_qwen2_and_its_vision_tower(tmp_path):
    import json

    from services.worker.images import image_spec
    from services.worker.model_config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_PROCESSOR))
    config = ModelConfig.from_hf_config(tmp_path / "config.json")
    assert (config.architecture, config.num_layers, config.num_kv_heads, config.head_dim, config.rope_theta) == \
        ("Qwen2_5_VLForConditionalGeneration", 28, 4, 128, 1e6)
    assert config.attention_bias and config.sliding_window is None and config.mrope_section == [16, 24, 24]
    vision = config.vision
    assert (vision.num_layers, vision.hidden_size, vision.full_attention_layers, vision.token_pixels) == \
        (32, 1280, (7, 15, 23, 31), 28)
    spec = image_spec(vision)
    assert (spec.token_id, spec.start_id, spec.end_id, spec.patch, spec.max_pixels) == \
        (151655, 151652, 151653, 28, 12845056)
    assert spec.resized(640, 480) == (644, 476) and spec.tokens_for(644, 476) == 23 * 17


def test_the_qaic_backend_refuses_it_by_name(checkpoint):
    from services.worker.backends.qaic.backend import QaicBackend
    from services.worker.backends.spec import WorkerSpec
    from shared.config import ConfigError

    spec = WorkerSpec(model_path=checkpoint[1], load_format="auto", kv_cache_bytes=lambda _: 0)
    with pytest.raises(ConfigError, match="Qwen2_5_VLForConditionalGeneration is an image-text model, which the qaic "
                                          "backend does not serve: .* M-RoPE's three positions a token"):
        QaicBackend.create(spec.with_dtype_for("qaic"), device="cpu")
