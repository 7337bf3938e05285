"""The CUDA backend's whole forward (Triton kernels, its inputs, its sampler) against the torch
backend in float32, on a GPU where there is one, else on the CPU under TRITON_INTERPRET=1: the same
greedy tokens on SmolLM2, and on small random models (a Llama with GQA, a Qwen3, a Qwen3-MoE, a
Gemma 3 with sliding windows, a soft-capped Gemma 2) the same tokens batched as alone, with
prefix-cache hits, chunked prefills and preemption, with speculative decoding's drafts (n-gram and a
draft model) and the host KV tier. (CUDA graphs and memory sizing need a GPU: tests/gpu/.)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from services.worker.backends.cuda.backend import CudaBackend
from services.worker.backends.cuda.ops import TritonOps
from services.worker.backends.cuda.sampler import device_sample, is_plain
from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.logits_processors import SampleRow
from services.worker.model_runner import ModelRunner
from shared.wire.messages import SamplingParams
from tests.inproc_engine import BLOCK_SIZE, InProcessEngine
from tests.model_helpers import greedy_generate, make_runner

pytestmark = pytest.mark.slow  # Triton interpreted on the CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_model(path: str, load_format: str = "auto"):
    return load_model(path, load_format, ops=TritonOps(), device=DEVICE)


def cuda_runner(loaded, num_blocks: int) -> ModelRunner:
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, torch.float32), num_blocks, DEVICE)
    return ModelRunner(backend, max_model_len=8192, eos_token_ids=loaded.config.eos_token_ids)


def test_smollm2_greedy_tokens_equal_the_torch_backends(default_model_path, loaded_model, hf_tokenizer):
    triton = triton_model(default_model_path)
    ids = hf_tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    assert greedy_generate(cuda_runner(triton, 16), ids, 6) == greedy_generate(make_runner(loaded_model), ids, 6)


@pytest.mark.parametrize("family", ["small_llama", "small_qwen3", "small_qwen3_moe", "small_gemma3",
                                    "small_gemma2"])
def test_batched_prefix_hits_and_preemption_give_the_torch_backends_tokens(request, family):
    config = request.getfixturevalue(family)
    reference, triton = load_model(config, "dummy", ops=TORCH_OPS), triton_model(config, "dummy")
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 299, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 299, (n,), generator=gen).tolist() for n in (3, 20, 37)]
    prompts.append(torch.randint(0, 299, (5,), generator=gen).tolist())
    outputs = []
    for loaded, runner in ((reference, None), (triton, cuda_runner(triton, 11))):
        # 11 blocks of 16: the four requests cannot all grow at once, so some are preempted
        engine = InProcessEngine(loaded, num_blocks=11, max_num_batched_tokens=48, runner=runner)
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 12, ignore_eos=True)
        outputs.append(engine.run())
        assert engine.scheduler.num_preemptions > 0
        assert sum(engine.num_cached_tokens.values()) > 0  # the shared prefix hit the cache
    assert outputs[1] == outputs[0]


def test_speculation_on_the_cuda_path_gives_the_torch_backends_tokens(small_llama):
    """n-gram drafts verified by the CUDA path's kernels (a draft's position a decode query): the
    torch backend's tokens without speculation, with drafts accepted."""
    reference, triton = load_model(small_llama, "dummy", ops=TORCH_OPS), triton_model(small_llama, "dummy")
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 299, (5,), generator=gen).tolist()
    prompts = [motif * 5, torch.randint(0, 299, (9,), generator=gen).tolist() * 3]
    outputs = []
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for loaded, runner, speculative in ((reference, None, None), (triton, cuda_runner(triton, 16), spec)):
        engine = InProcessEngine(loaded, num_blocks=16, runner=runner, speculative=speculative)
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 16, ignore_eos=True)
        outputs.append(engine.run())
    assert outputs[1] == outputs[0]
    assert sum(d.num_accepted for d in engine.drafts) > 0


@pytest.mark.parametrize("drafter", ["small_llama", "small_qwen3"])
def test_a_draft_model_on_the_cuda_path_gives_the_torch_backends_tokens(request, small_llama, drafter):
    """The draft_model method on the CUDA path, both models on its kernels, the draft's KV in the
    target's blocks: the torch backend's tokens without speculation. The target drafting for itself
    has its drafts kept; a random Qwen3 of its vocabulary has most rejected; 8 blocks preempt."""
    reference, triton = load_model(small_llama, "dummy", ops=TORCH_OPS), triton_model(small_llama, "dummy")
    draft = triton_model(request.getfixturevalue(drafter), "dummy")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 299, (n,), generator=gen).tolist() for n in (6, 23, 40)]
    spec = {"method": "draft_model", "model": "the-draft", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    outputs, engines = [], []
    for loaded, runner, speculative in ((reference, None, None), (triton, cuda_runner(triton, 8), spec)):
        engine = InProcessEngine(loaded, num_blocks=8, max_num_batched_tokens=32, runner=runner,
                                 speculative=speculative, draft=draft)
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 20, ignore_eos=True)
        outputs.append(engine.run())
        engines.append(engine)
    assert outputs[1] == outputs[0]
    drafted, accepted = (sum(getattr(d, k) for d in engines[1].drafts) for k in ("num_drafted", "num_accepted"))
    assert accepted > drafted / 2 if drafter == "small_llama" else accepted < drafted / 2
    assert engines[1].scheduler.num_preemptions > 0
    assert "draft model" in engines[1].runner.backend.describe().device


def test_device_sampling_is_seeded_per_request_and_batch_invariant():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [SampleRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=20), seed=s, output_index=4) for s in (1, 2, 3)]
    together = device_sample(logits, rows).tolist()
    alone = [device_sample(logits[i : i + 1], [rows[i]]).item() for i in range(3)]
    assert together == alone
    # the draws follow the distribution: 4,000 seeds over a 3-token softmax
    probs = torch.tensor([0.6, 0.3, 0.1])
    many = [SampleRow(SamplingParams(temperature=1.0), seed=s, output_index=0) for s in range(4000)]
    drawn = device_sample(probs.log().expand(4000, 3).clone(), many)
    freq = torch.bincount(drawn, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    # top_k=1 is greedy; rows with processors or logprobs go to the CPU sampler
    assert device_sample(logits[:1], [SampleRow(SamplingParams(top_k=1), seed=9, output_index=0)]).item() == \
        int(logits[0].argmax())
    assert not is_plain(SampleRow(SamplingParams(logit_bias={3: 5.0}), seed=0, output_index=0))
    assert not is_plain(SampleRow(SamplingParams(logprobs=1), seed=0, output_index=0))


def test_llama31_rope_scaling_matches_transformers_on_the_cuda_path(tmp_path):
    """Llama 3.1's scaled frequencies through the Triton rotary and attention. The frequencies are the
    model's, whatever the backend (tests/test_llama3_configs.py checks them at 1,500 positions, past
    the blended wavelengths); here 300 positions over 19 blocks, interpreted, which unscaled
    frequencies move by 0.03 (this path's difference from transformers: 2.4e-6)."""
    from tests.model_helpers import prefill_logits
    from tests.test_llama3_configs import _save

    hf, path = _save(tmp_path, "Llama-3.1-8B", "transformers5")
    loaded = triton_model(str(path))
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_logits(cuda_runner(loaded, 24), ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.cpu(), theirs, atol=2e-4, rtol=1e-3)


def test_the_host_kv_tier_on_the_cuda_path_gives_the_torch_backends_tokens(small_llama, tmp_path):
    """Conversations over a 6-block pool on the CUDA backend, their histories loaded back from the
    host tier (the copies through the host, as on a GPU): the torch backend's tokens on a pool that
    never evicts."""
    from services.worker.kv_tier import HostTier

    reference, triton = load_model(small_llama, "dummy", ops=TORCH_OPS), triton_model(small_llama, "dummy")
    runner = cuda_runner(triton, 6)
    directory = Path(tempfile.mkdtemp(dir="/dev/shm")) if DEVICE.type == "cuda" else tmp_path  # pinned on a GPU
    tier = HostTier.open("cuda-test", runner.backend.kv_tensors(), 0.01, directory=directory)
    assert (tier.copies is not None) == (DEVICE.type == "cuda")
    try:
        tiered = InProcessEngine(triton, num_blocks=6, runner=runner, tier=tier)
        alone = InProcessEngine(reference, num_blocks=64)
        gen = torch.Generator().manual_seed(3)
        histories = [torch.randint(0, 299, (40,), generator=gen).tolist() for _ in range(3)]
        for turn in range(3):
            for i, history in enumerate(histories):
                for engine in (tiered, alone):
                    engine.add(f"c{i}-t{turn}", history, 6, ignore_eos=True)
                    engine.run()
                assert tiered.outputs[f"c{i}-t{turn}"] == alone.outputs[f"c{i}-t{turn}"]
                history += tiered.outputs[f"c{i}-t{turn}"] + torch.randint(0, 299, (10,), generator=gen).tolist()
        assert tiered.scheduler.kv.tier.num_loaded > 0
    finally:
        tier.close()
        if directory != tmp_path:
            shutil.rmtree(directory)
