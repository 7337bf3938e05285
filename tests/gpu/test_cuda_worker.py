"""The CUDA backend on a real GPU: exact in float32 against the torch CPU path, bf16 against
transformers, CUDA graphs on and off, fp8 KV, prefix hits and preemption, and the whole stack
through the openai client. Skipped without a GPU (CI has none); run on a lent one:
    python -m pytest tests/gpu tests/kernels
(tests/kernels then runs each kernel on CUDA tensors, in bfloat16 too.)
"""

from __future__ import annotations

import pytest
import torch

from tests.inproc_engine import BLOCK_SIZE, InProcessEngine
from tests.model_helpers import greedy_generate, make_runner
from tests.test_llama_vs_hf import PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda")


def cuda_runner(path: str, dtype: torch.dtype, num_blocks: int = 512, kv_dtype: torch.dtype | None = None,
                use_graphs: bool = True, max_num_seqs: int = 16, max_seq_len_to_capture: int = 8192):
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.kv_pool import KVSpec
    from services.worker.loader import load_model
    from services.worker.model_runner import ModelRunner

    loaded = load_model(path, dtype=dtype, ops=TritonOps(), device=DEVICE)
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, kv_dtype or dtype), num_blocks, DEVICE,
                          capture=(max_num_seqs, max_seq_len_to_capture) if use_graphs else None)
    backend.warm_up()
    return ModelRunner(backend, max_model_len=8192, eos_token_ids=loaded.config.eos_token_ids), loaded


def test_float32_greedy_tokens_equal_the_torch_cpu_path(default_model_path, loaded_model, hf_tokenizer):
    runner, _ = cuda_runner(default_model_path, torch.float32)
    reference = make_runner(loaded_model)
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        assert greedy_generate(runner, ids, 32) == greedy_generate(reference, ids, 32), prompt


def test_bfloat16_agrees_with_transformers_on_the_gpu(default_model_path, hf_tokenizer):
    import os

    import transformers

    from tests.model_helpers import prefill_logits

    runner, _ = cuda_runner(default_model_path, torch.bfloat16)
    folder, name = os.path.split(default_model_path)  # its own copy: the session's hf_model stays float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    hf = hf.to(DEVICE).eval()
    agree = total = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours = prefill_logits(runner, ids).float()
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids], device=DEVICE)).logits[0].float()
        assert (ours - theirs).abs().max() < 1.5, prompt
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
    assert agree >= 0.95 * total, f"{agree}/{total}"


def _batched_greedy(runner, hf_tokenizer, num_seqs: int, max_tokens: int) -> dict[str, list[int]]:
    engine = InProcessEngine(None, num_blocks=runner.backend.num_blocks, runner=runner)
    for i in range(num_seqs):
        engine.add(f"r{i}", hf_tokenizer.encode(PROMPTS[i % len(PROMPTS)]), max_tokens, ignore_eos=True)
    return engine.run()


def test_cuda_graphs_on_and_off_give_the_same_tokens(default_model_path, hf_tokenizer):
    graphed, _ = cuda_runner(default_model_path, torch.bfloat16)
    eager, _ = cuda_runner(default_model_path, torch.bfloat16, use_graphs=False)
    replays = []
    run = graphed.backend.graphs.run
    graphed.backend.graphs.run = lambda inputs: replays.append(inputs.input_ids.shape[0]) or run(inputs)
    for num_seqs in (1, 3, 8, 13):
        assert _batched_greedy(graphed, hf_tokenizer, num_seqs, 24) == _batched_greedy(eager, hf_tokenizer, num_seqs, 24)
    assert {1, 3, 8, 13} <= set(replays)  # every batch size decoded through a graph (13 padded to 16)


def test_contexts_past_max_seq_len_to_capture_run_eagerly(default_model_path, hf_tokenizer):
    runner, _ = cuda_runner(default_model_path, torch.bfloat16, max_seq_len_to_capture=64)
    replays, eager_steps = [], []
    graphs = runner.backend.graphs
    run = graphs.run
    graphs.run = lambda inputs: replays.append(inputs.meta.max_decode_len) or run(inputs)
    forward = runner.backend.model.forward
    runner.backend.model.forward = lambda *a: eager_steps.append(a[0].shape[0]) or forward(*a)
    ids = (hf_tokenizer.encode(PROMPTS[0]) * 8)[:40]  # the prompt is 5 tokens: repeated to 40
    greedy_generate(runner, ids, 40)  # contexts 41..80: graphs up to 64, then eager
    assert replays and max(replays) <= 64
    assert len(eager_steps) >= 80 - 64  # the prefill, and every decode past 64


def test_prefix_hits_and_preemption_give_lone_tokens_on_the_gpu(default_model_path, hf_tokenizer):
    # 10 blocks of 16: four 52-token sequences sharing their first block cannot all grow at once
    runner, _ = cuda_runner(default_model_path, torch.float32, num_blocks=10)
    shared = hf_tokenizer.encode(PROMPTS[1]) * 3
    engine = InProcessEngine(None, num_blocks=10, max_num_batched_tokens=64, runner=runner)
    for i in range(4):
        engine.add(f"r{i}", shared + [1000 + i], 30, ignore_eos=True)
    batched = engine.run()
    assert engine.scheduler.num_preemptions > 0 and sum(engine.num_cached_tokens.values()) > 0
    lone, _ = cuda_runner(default_model_path, torch.float32)
    for i in range(4):
        assert batched[f"r{i}"] == greedy_generate(lone, shared + [1000 + i], 30)


def test_fp8_kv_cache_keeps_most_greedy_tokens(default_model_path, hf_tokenizer):
    fp8, _ = cuda_runner(default_model_path, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    bf16, _ = cuda_runner(default_model_path, torch.bfloat16)
    assert fp8.backend.kv_caches[0][0].dtype == torch.float8_e4m3fn
    agree = total = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        a, b = greedy_generate(fp8, ids, 16), greedy_generate(bf16, ids, 16)
        agree += sum(x == y for x, y in zip(a, b, strict=True))
        total += 16
    assert agree >= 0.6 * total, f"{agree}/{total}"


@pytest.mark.stack
def test_the_stack_serves_through_the_openai_client_on_the_gpu(tmp_path_factory, model_name):
    import openai

    from tests.conftest import _start_stack

    # the suite's --deterministic (tests/conftest.py) is the cpu backend's: a cuda worker refuses it
    stack = _start_stack(tmp_path_factory, "cuda-stack", num_workers=1,
                         extra_args=["--device", "cuda", "--no-deterministic"])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        models = client.models.list().data
        assert models[0].max_model_len > 0
        reply = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8,
                                          temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
        assert reply.choices[0].text == streamed and reply.usage.completion_tokens == 8
    finally:
        stack.stop()


@pytest.mark.parametrize("weights", ["float", "int4"])  # int4: every layer's Linear on quant_gemm
def test_the_gpu_benchmark_reports_every_figure(tmp_path, weights):
    import json

    from bench import gpu_decode

    config = json.loads(open("bench/configs/llama-3.1-8b.json").read())
    config.update(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=1, vocab_size=1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = gpu_decode.main(["--config", str(path), "--context", "64", "--big-batch", "8", "--prefill-len", "256",
                              "--repeat", "3", "--weights", weights])
    assert report["bandwidth_gb_s"] > 100 and report["weights"] == weights
    for key in ("decode_b1", "decode_b8"):
        assert report[key]["tok_s"] > 0 and 0 < report[key]["of_roofline"] < 1.5
    assert report["prefill"]["tflop_s"] > 0


def test_an_awq_checkpoints_integers_on_the_gpu_give_the_cpu_backends_tokens(tmp_path, cpu_kernels):
    """The file's integers on kernels/quant_gemm.py, in float32 with CUDA graphs: the torch CPU
    backend's greedy tokens on the same integers (quant_linear)."""
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.cuda.quant_linear import kept_linears, quantize
    from services.worker.backends.kv_pool import KVSpec
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS
    from services.worker.backends.torch_cpu.quantization import kept_weights
    from services.worker.backends.torch_cpu.quantization import quantize as cpu_quantize
    from services.worker.loader import load_model
    from services.worker.model_runner import ModelRunner
    from tests import quant_checkpoints as qc

    folder = str(qc.awq(qc.tiny_llama(), tmp_path / "awq"))
    loaded = load_model(folder, ops=TritonOps(), device=DEVICE, keep=kept_linears)
    quantize(loaded.model, loaded.blocks, loaded.unloaded).to(DEVICE)
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, torch.float32), 64, DEVICE, capture=(8, 512))
    backend.warm_up()
    runner = ModelRunner(backend, max_model_len=512, eos_token_ids=[])
    cpu = load_model(folder, ops=NATIVE_OPS, keep=kept_weights)
    cpu_quantize(cpu.model, "awq", cpu.blocks, cpu.unloaded)
    ids = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19]
    assert greedy_generate(runner, ids, 24) == greedy_generate(make_runner(cpu), ids, 24)
