"""LoRA adapters against their oracle: the base model with PEFT's merged weights (transformers + peft,
random weights and random adapters saved by each), alone and in one batch mixing four adapters and
the base; the adapter key in the prefix cache; what is refused and why."""

from __future__ import annotations

import json

import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.lora.adapter import LoraError, load_adapter
from services.worker.lora.manager import LoraLimits, LoraManager
from shared.wire.messages import NewSeq, SamplingParams, Step
from tests.inproc_engine import InProcessEngine
from tests.model_helpers import BLOCK_SIZE, make_runner

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# (name, rank, alpha, rsLoRA, target modules): every module, attention alone, the MLP alone, ranks 4..16
ADAPTERS = [("all-r8", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            ("qv-r16-rs", 16, 8, True, ["q_proj", "v_proj"]),
            ("attn-r4", 4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("mlp-r8", 8, 32, False, ["gate_proj", "up_proj", "down_proj"])]
PROMPT_LENS = {"base": 37, "all-r8": 20, "qv-r16-rs": 45, "attn-r4": 16, "mlp-r8": 29}


def small_config(**overrides):
    """A 2-layer Llama with Llama 3's 4 query heads per KV head (random weights, shrunk width and depth)."""
    return transformers.LlamaConfig(**{
        "vocab_size": 300, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "eos_token_id": 299, "tie_word_embeddings": False, **overrides})


def save_adapter(base, folder, rank, alpha, rslora, targets, seed):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    model.save_pretrained(folder)
    return model.unload()  # the base model back, unchanged


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """(base model folder, {adapter: folder}) written by transformers and peft."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(small_config()).eval()
    root = tmp_path_factory.mktemp("lora")
    base.save_pretrained(root / "base", safe_serialization=True)
    adapters = {}
    for seed, (name, rank, alpha, rslora, targets) in enumerate(ADAPTERS):
        base = save_adapter(base, root / name, rank, alpha, rslora, targets, seed + 1)
        adapters[name] = str(root / name)
    return str(root / "base"), adapters


def merged(base_dir: str, adapter_dir: str | None):
    """transformers' model with the adapter's weights merged in by peft (the oracle)."""
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    return peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()


def our_runner(base_dir: str, adapters: dict[str, str], max_loras: int = 4, max_cpu_loras: int | None = None):
    runner = make_runner(load_model(base_dir, "auto", torch.float32, ops=TORCH_OPS), num_blocks=64)
    runner.lora = LoraManager(runner.backend.model, runner.backend.config, LoraLimits(max_loras, 16, max_cpu_loras))
    for name, path in adapters.items():
        runner.lora.add(name, path)
    return runner


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {name: torch.randint(0, 299, (n,), generator=gen).tolist() for name, n in PROMPT_LENS.items()}


def test_a_mixed_batch_gives_each_adapter_the_logits_of_its_merged_model(lora_model):
    """One prefill step of five prompts (the base and four adapters, ranks 4-16, rsLoRA, attention or
    MLP alone), then each alone: every position's logits within 2e-4 of transformers with PEFT's
    merged weights."""
    base_dir, adapters = lora_model
    runner = our_runner(base_dir, adapters)
    ids = prompts()
    new, block = [], 0
    for name, prompt in ids.items():
        blocks = list(range(block, block + (len(prompt) + BLOCK_SIZE - 1) // BLOCK_SIZE))
        block += len(blocks)
        new.append(NewSeq(request_id=name, token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
                          num_new_tokens=len(prompt), block_ids=blocks, sampling=SamplingParams(max_tokens=1),
                          reply_to="", lora=None if name == "base" else name))
    batch = runner.apply_deltas(Step(step_id=0, new_seqs=new))
    with torch.inference_mode():
        logits = runner.backend.compute_logits(runner.forward(batch))
    start = 0
    for name, prompt in ids.items():
        with torch.inference_mode():
            expected = merged(base_dir, adapters.get(name))(torch.tensor([prompt])).logits[0]
        ours = logits[start : start + len(prompt)]
        start += len(prompt)
        assert (ours - expected).abs().max().item() < 2e-4, name
    for name, prompt in ids.items():  # each alone, in a step of its own: the same logits
        new = [NewSeq(request_id=f"alone-{name}", token_ids=prompt, num_prompt_tokens=len(prompt),
                      num_computed_tokens=0, num_new_tokens=len(prompt), block_ids=list(range(40, 44)),
                      sampling=SamplingParams(max_tokens=1), reply_to="", lora=None if name == "base" else name)]
        batch = runner.apply_deltas(Step(step_id=1, new_seqs=new, reset=True))
        with torch.inference_mode():
            alone = runner.backend.compute_logits(runner.forward(batch))
            expected = merged(base_dir, adapters.get(name))(torch.tensor([prompt])).logits[0]
        assert (alone - expected).abs().max().item() < 2e-4, name
    with torch.inference_mode():  # and the adapters change the logits (the test would pass on no-ops otherwise)
        plain = merged(base_dir, None)(torch.tensor([ids["all-r8"]])).logits[0]
    assert (logits[37:57] - plain).abs().max().item() > 1e-2


def test_greedy_tokens_alone_and_batched_equal_the_merged_models(lora_model):
    """Through the real scheduler (chunked prefill, prefix caching, a pool small enough to preempt):
    each adapter's greedy tokens equal its merged model's, alone and in a batch with the others, and
    the same prompt on two adapters shares no KV block."""
    base_dir, adapters = lora_model
    ids = prompts()
    shared_prompt = ids["base"]  # every request starts with the same 37 tokens: only the adapter differs
    expected = {}
    for name in ids:
        model = merged(base_dir, adapters.get(name))
        with torch.inference_mode():
            out = model.generate(torch.tensor([shared_prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        expected[name] = out[0, len(shared_prompt):].tolist()
    assert len({tuple(v) for v in expected.values()}) == len(expected)  # each adapter answers its own way
    runner = our_runner(base_dir, adapters, max_loras=2, max_cpu_loras=2)  # slots and host memory both evict
    engine = InProcessEngine(None, num_blocks=12, max_num_batched_tokens=32, runner=runner)
    engine.scheduler.max_loras = 2
    for name in ids:
        engine.add(name, shared_prompt, 12, min_tokens=12)
        engine.scheduler.requests[name].lora = None if name == "base" else name
    outputs = engine.run()
    assert outputs == expected and not engine.errors
    assert all(n == 0 for n in engine.num_cached_tokens.values())  # same tokens, other adapters: no shared KV
    again = InProcessEngine(None, num_blocks=64, runner=our_runner(base_dir, adapters))
    again.scheduler.max_loras = 4
    for i in range(2):  # the same adapter twice: the second request's prefix comes from the cache
        again.add(f"twice-{i}", shared_prompt, 12, min_tokens=12)
        again.scheduler.requests[f"twice-{i}"].lora = "mlp-r8"
        again.run()
    assert again.outputs["twice-1"] == expected["mlp-r8"] and again.num_cached_tokens["twice-1"] == 32


def test_speculating_rows_on_adapters_keep_their_merged_models_tokens(lora_model):
    """n-gram drafts verified on LoRA rows (a row's adapter applies to its drafts too), beside a row
    of the base model: each keeps its merged model's greedy tokens, and drafts were kept."""
    base_dir, adapters = lora_model
    motif = torch.randint(0, 299, (6,), generator=torch.Generator().manual_seed(11)).tolist()
    prompt, names = motif * 5, ["base", "all-r8", "mlp-r8"]
    expected = {}
    for name in names:
        with torch.inference_mode():
            out = merged(base_dir, adapters.get(name)).generate(torch.tensor([prompt]), max_new_tokens=16,
                                                                min_new_tokens=16, do_sample=False)
        expected[name] = out[0, len(prompt):].tolist()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engine = InProcessEngine(None, num_blocks=64, runner=our_runner(base_dir, adapters), speculative=spec)
    engine.scheduler.max_loras = 4
    for name in names:
        engine.add(name, prompt, 16, min_tokens=16)
        engine.scheduler.requests[name].lora = None if name == "base" else name
    assert engine.run() == expected and not engine.errors
    assert sum(d.num_accepted for d in engine.drafts) > 0


def test_an_unknown_adapter_fails_its_row_alone(lora_model):
    base_dir, adapters = lora_model
    runner = our_runner(base_dir, {"all-r8": adapters["all-r8"]})
    new = [NewSeq(request_id=r, token_ids=[1, 2, 3], num_prompt_tokens=3, num_computed_tokens=0, num_new_tokens=3,
                  block_ids=[i], sampling=SamplingParams(max_tokens=2), reply_to="", lora=lora)
           for i, (r, lora) in enumerate([("ok", "all-r8"), ("bad", "nobody")])]
    out = runner.execute(Step(step_id=0, new_seqs=new))
    by_id = {s.request_id: s for s in out.sampled}
    assert by_id["ok"].token_id >= 0 and by_id["bad"].token_id == -1
    assert "'nobody' is not loaded" in by_id["bad"].error


def test_adapters_that_do_not_fit_are_refused_by_name(lora_model, tmp_path):
    base_dir, adapters = lora_model
    cfg = load_model(base_dir, "auto", torch.float32, ops=TORCH_OPS).config
    with pytest.raises(LoraError, match="rank 16 is over --max-lora-rank 8"):
        load_adapter("big", adapters["qv-r16-rs"], cfg, max_rank=8)
    torch.manual_seed(0)
    other = transformers.LlamaForCausalLM(small_config(hidden_size=64, head_dim=8)).eval()
    save_adapter(other, tmp_path / "other", 8, 16, False, ["q_proj"], 3)
    with pytest.raises(LoraError, match="is for another base model: q_proj of layer 0"):
        load_adapter("other", str(tmp_path / "other"), cfg, max_rank=16)
    save_adapter(transformers.LlamaForCausalLM(small_config()).eval(), tmp_path / "head", 8, 16, False, ["lm_head"], 4)
    with pytest.raises(LoraError, match="'head'.*lm_head"):
        load_adapter("head", str(tmp_path / "head"), cfg, max_rank=16)
    config = json.loads((tmp_path / "other" / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes((tmp_path / "other" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoraError, match="use_dora=True is not supported"):
        load_adapter("dora", str(tmp_path / "dora"), cfg, max_rank=16)
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load_adapter("none", str(tmp_path), cfg, max_rank=16)


@pytest.mark.slow  # Triton interpreted on the CPU
def test_the_cuda_backends_lora_kernels_give_the_torch_paths_tokens(lora_model):
    """The CUDA backend (its Triton kernels interpreted on the CPU, float32) with four adapters and the
    base in one batch: each request's greedy tokens equal the torch path's."""
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.kv_pool import KVSpec
    from services.worker.model_runner import ModelRunner

    base_dir, adapters = lora_model
    loaded = load_model(base_dir, "auto", torch.float32, ops=TritonOps())
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, torch.float32), 24, torch.device("cpu"))
    triton = ModelRunner(backend, max_model_len=8192, eos_token_ids=loaded.config.eos_token_ids,
                         lora=LoraManager(loaded.model, loaded.config, LoraLimits(4, 16)))
    for name, path in adapters.items():
        triton.lora.add(name, path)
    outputs = []
    for runner in (our_runner(base_dir, adapters), triton):
        engine = InProcessEngine(None, num_blocks=24, max_num_batched_tokens=48, runner=runner)
        engine.scheduler.max_loras = 4
        for name, prompt in prompts().items():
            engine.add(name, prompt, 8, min_tokens=8)
            engine.scheduler.requests[name].lora = None if name == "base" else name
        outputs.append(engine.run())
    assert outputs[1] == outputs[0]
