"""Speculative decoding's draft_model method on a real GPU, as a worker creates it: both models on
the device, the draft's KV in the target's blocks (the pool sized by profiling with both loaded),
each replaying CUDA graphs of its own; greedy tokens the torch CPU path's without speculation.
(tests/kernels/test_cuda_backend.py and tests/test_eagle3.py run the draft model and an EAGLE-3
head on the GPU too, eagerly.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.inproc_engine import BLOCK_SIZE, InProcessEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
VOCAB = 512


def _llama(folder, layers: int, seed: int) -> str:
    """Random weights saved by transformers (a Llama of VOCAB tokens): the target and its drafts."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> str:
    return _llama(tmp_path_factory.mktemp("target"), 4, 0)


@pytest.mark.parametrize("drafter", ["itself", "random"])
def test_a_draft_model_with_graphs_gives_the_torch_cpu_paths_tokens(target_path, tmp_path, drafter):
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from services.worker.model_runner import ModelRunner

    draft_path = target_path if drafter == "itself" else _llama(tmp_path / "draft", 1, 1)
    # itself: the pool sized by profiling with both models loaded; random: a pool of its own size (a
    # profile counts what the process holds, and pytest may hold a failed test's pool)
    spec = WorkerSpec(model_path=target_path, kv_cache_bytes=lambda _: 0, dtype="float32", block_size=BLOCK_SIZE,
                      draft_model_path=draft_path, gpu_memory_utilization=0.2, max_num_seqs=8,
                      max_seq_len_to_capture=512, num_kv_blocks=None if drafter == "itself" else 256)
    backend = CudaBackend.create(spec)
    backend.warm_up()
    assert backend.graphs is not None and backend.draft.graphs is not None
    assert backend.draft.num_blocks == backend.num_blocks and "draft model LlamaForCausalLM of" in backend.describe().device
    runner = ModelRunner(backend, max_model_len=4096, eos_token_ids=[])
    reference = load_model(target_path, ops=TORCH_OPS)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 31, 70)]
    speculative = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 4,
                   "disable_by_batch_size": 8}
    outputs = []
    for loaded, runner_, config in ((reference, None, None), (None, runner, speculative)):
        engine = InProcessEngine(loaded or reference, num_blocks=64, runner=runner_, speculative=config)
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 32, ignore_eos=True)
        outputs.append(engine.run())
    assert outputs[1] == outputs[0]
    drafted, accepted = (sum(getattr(d, k) for d in engine.drafts) for k in ("num_drafted", "num_accepted"))
    assert accepted > drafted / 2 if drafter == "itself" else accepted < drafted
