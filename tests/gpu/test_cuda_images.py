"""The CUDA backend's image path on a real GPU: Gemma 3 (its image tokens seen both ways by the
prefill kernel) and Qwen2.5-VL (M-RoPE), float32 with CUDA graphs for the decode steps, give the
torch CPU path's tokens and logits; bfloat16's stay near. Shrunk random checkpoints
(tests/image_checkpoints.py). Skipped without a GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from tests.image_checkpoints import gemma3_vision, qwen25vl
from tests.model_helpers import cuda_image_runner, greedy_with_images, make_runner
from tests.test_gemma3_vision import _prompt as gemma3_prompt
from tests.test_qwen25vl import _pictures, _prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["gemma3", "qwen25vl"])
def family(request, tmp_path_factory):
    """(checkpoint folder, prompt ids, image refs, their pixels, block ids)."""
    from shared.wire.images import ImageRef

    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        gemma3_vision(folder)
        ids, spans = gemma3_prompt()
        refs = [ImageRef(key=f"img{i}", offset=b, num_tokens=e - b) for i, (b, e) in enumerate(spans)]
        raw = torch.randint(0, 256, (len(spans), 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        return str(folder), ids, refs, [p.numpy().tobytes() for p in raw], [0, 1]
    qwen25vl(folder)
    ids, refs = _prompt()
    return str(folder), ids, refs, [p.tobytes() for p in _pictures(2)], [0, 1, 2, 3]


def test_float32_with_graphs_gives_the_torch_cpu_paths_tokens(family):
    folder, ids, refs, pixels, blocks = family
    want_tokens, want = greedy_with_images(make_runner(load_model(folder, ops=TORCH_OPS), num_blocks=16), ids, refs,
                                           pixels, blocks, 6)
    runner = cuda_image_runner(folder, device="cuda", graphs=True)
    replays = []
    run = runner.backend.graphs.run
    runner.backend.graphs.run = lambda inputs: replays.append(inputs.input_ids.shape[0]) or run(inputs)
    got_tokens, got = greedy_with_images(runner, ids, refs, pixels, blocks, 6)
    assert replays, "no decode step ran through a CUDA graph"
    assert got_tokens == want_tokens
    for a, b in zip(got, want, strict=True):  # TF32 may round the GEMMs: near, not exact
        assert torch.allclose(a.cpu(), b, atol=2e-3, rtol=0)


def test_bfloat16_logits_stay_near_float32s(family):
    folder, ids, refs, pixels, blocks = family
    fp32 = greedy_with_images(cuda_image_runner(folder, device="cuda"), ids, refs, pixels, blocks, 0)[1][0]
    bf16 = greedy_with_images(cuda_image_runner(folder, device="cuda", dtype=torch.bfloat16), ids, refs, pixels,
                              blocks, 0)[1][0].float()
    error = float((bf16 - fp32).abs().max() / fp32.abs().max())
    print(f"bf16 max error {error:.4f} of float32's largest logit")
    assert error < 0.05
