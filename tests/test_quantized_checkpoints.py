"""Quantized safetensors checkpoints (AWQ, GPTQ, compressed-tensors): the worker's weights are the
format's own dequantization to the bit, its integers stay resident in about the file's bytes, and
its logits are transformers' on those weights. Random weights on a small Llama (tests/quant_checkpoints.py
says who wrote each checkpoint and what its oracle is)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu.quantization import QuantLinear, kept_weights, quantize
from services.worker.loader import hf_dir, load_model
from shared.config import ConfigError
from tests import quant_checkpoints as qc
from tests.model_helpers import make_runner, prefill_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

# (name, writer, method as --quantization auto picks it)
CHECKPOINTS = {
    "ct-w4a16": ("compressed-tensors", lambda m, d: qc.compressed_tensors(m, d / "q", "w4a16")),
    "ct-w4a16-sym": ("compressed-tensors", lambda m, d: qc.compressed_tensors(m, d / "q", "w4a16-sym")),
    "ct-w4a16-channel": ("compressed-tensors", lambda m, d: qc.compressed_tensors(m, d / "q", "w4a16-channel")),
    "ct-w8a8-int8": ("compressed-tensors", lambda m, d: qc.compressed_tensors(m, d / "q", "w8a8")),
    "ct-fp8": ("compressed-tensors", lambda m, d: qc.compressed_tensors(m, d / "q", "fp8")),
    "awq-g128": ("awq", lambda m, d: qc.awq(m, d / "q", 128)),
    "awq-g64": ("awq", lambda m, d: qc.awq(m, d / "q", 64)),
    "gptq-g128": ("gptq", lambda m, d: qc.gptq(m, d / "q")),
    "gptq-act-order": ("gptq", lambda m, d: qc.gptq(m, d / "q", act_order=True)),
    "gptq-sym-channel": ("gptq", lambda m, d: qc.gptq(m, d / "q", group=256, sym=True)),
}
IDS = [3, 17, 99, 4, 200, 31, 7, 7, 8, 120, 45, 2, 19, 77, 101, 5, 64, 33, 12, 300, 301, 2, 511]


def _write(name: str, tmp_path):
    method, writer = CHECKPOINTS[name]
    written = writer(qc.tiny_llama(), tmp_path)
    if isinstance(written, tuple):  # gptq: the packer's own integers are the oracle
        return method, *written
    folder = written
    weights = qc.awq_weights(folder, tmp_path / "as-ct") if method == "awq" else qc.compressed_tensors_weights(folder)
    return method, folder, weights


def _quantized_bytes(folder) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith(("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                              "weight_zero_point")) or (name.endswith(".weight") and "layers" in name
                                                        and "norm" not in name):
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_quantized_checkpoint_is_its_formats_weights_kept_and_transformers_logits(tmp_path, cpu_kernels, name):
    import structlog

    method, folder, expected = _write(name, tmp_path)
    with structlog.testing.capture_logs() as logs:
        _, dense = hf_dir.load(str(folder))  # --quantization none, and the CUDA and QAIC backends: dequantized
    said = [e["activations"] for e in logs if e["event"] == "checkpoint_activations"]
    if name in ("ct-w8a8-int8", "ct-fp8"):  # their dynamic 8-bit tokens are not applied here, and the log says so
        assert said and "computed in the model's float dtype" in said[0]
    else:
        assert not said
    for module, weight in expected.items():
        ours = hf_dir.our_name(module + ".weight")
        assert torch.equal(dense[ours], weight), module

    loaded = load_model(str(folder), keep=kept_weights, ops=_ops())
    quantize(loaded.model, method, loaded.blocks, loaded.unloaded)
    linears = {n: m for n, m in loaded.model.named_modules() if n.startswith("layers.") and
               isinstance(m, (nn.Linear, QuantLinear))}
    assert linears and all(isinstance(m, QuantLinear) for m in linears.values())
    wq = torch.cat([expected[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
    assert torch.equal(loaded.model.layers[0].attention.wqkv.dequantized, wq)  # the file's, fused
    if name == "ct-w8a8-int8":  # symmetric int8: the scale alone, no lows of zeros
        assert loaded.model.layers[0].attention.wqkv.lows is None
    if name == "ct-fp8":  # the float8 e4m3 codes themselves
        assert loaded.model.layers[0].attention.wqkv.qweight.dtype == torch.float8_e4m3fn
    resident = sum(b.numel() * b.element_size() for m in linears.values() for b in m.buffers())
    print(f"\n{name}: resident {resident / _quantized_bytes(folder):.2f}x the file's quantized tensors")
    assert resident <= 1.3 * _quantized_bytes(folder), (resident, _quantized_bytes(folder))

    oracle = transformers.LlamaForCausalLM.from_pretrained(qc.dense_folder(folder, expected, tmp_path / "dense")).eval()
    with torch.inference_mode():
        want = oracle(torch.tensor([IDS])).logits[0].float()
    got = prefill_logits(make_runner(loaded, num_blocks=8), IDS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _ops():
    from services.worker.backends.torch_cpu.ops import NATIVE_OPS

    return NATIVE_OPS


def test_auto_picks_the_checkpoints_own_format_and_a_wrong_name_is_refused(tmp_path):
    from shared.engine_defaults import checkpoint_quantization, own_quantization, pick

    folder = qc.awq(qc.tiny_llama(), tmp_path / "awq")
    assert checkpoint_quantization(str(folder)) == "awq"
    assert own_quantization(str(folder), "auto") == "awq" and own_quantization(str(folder), "dummy") is None
    picked = pick({}, kernels=None, checkpoint="awq").quantization
    assert picked.value == "awq" and "kept as they are" in picked.reason
    assert pick({}, kernels=None, quantization="awq", checkpoint="awq").quantization.value == "awq"
    assert pick({}, kernels=None, quantization="none", checkpoint="awq").quantization.value == "none"
    assert pick({}, kernels="not built", checkpoint="awq").quantization.value == "none"
    with pytest.raises(ConfigError, match="--quantization gptq names the checkpoint's own format, and this "
                                          "checkpoint's quantization_config names awq"):
        pick({}, kernels=None, quantization="gptq", checkpoint="awq")
    with pytest.raises(ConfigError, match="names none"):
        pick({}, kernels=None, quantization="compressed-tensors", checkpoint=None)


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not implemented"),
    ({"quant_method": "awq", "zero_point": False}, "AWQ without zero points is not implemented"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits is not implemented"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not implemented"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not implemented"),
    ({"quant_method": "fp8"}, "quant_method 'fp8' is not implemented"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "group"}}}},
     "actorder 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}}}},
     "float weights of 8 bits by block are not implemented"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}},
     "static int8 activations by tensor are not implemented"),
])
def test_what_is_not_implemented_is_refused_by_name(tmp_path, config, message):
    from services.worker.model_config import ModelConfig

    folder = tmp_path / "m"
    qc.tiny_llama().save_pretrained(folder)
    qc._set_quantization_config(folder, config)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(folder / "config.json")


@pytest.mark.stack
def test_an_awq_checkpoint_serves_on_make_runs_defaults(tmp_path_factory, hf_tokenizer):
    """An AutoAWQ checkpoint (the most common quantized safetensors on the Hub) served by `make run`'s
    services on their defaults: --quantization auto keeps its integers, and greedy completions
    through the openai client equal transformers' generate on its dequantized weights."""
    import json

    import openai

    from tests.conftest import _start_stack
    from tests.model_helpers import transformers_greedy

    tmp = tmp_path_factory.mktemp("awq-stack")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(qc.TINY | dict(vocab_size=len(hf_tokenizer), initializer_range=0.08,
                                                         eos_token_id=hf_tokenizer.eos_token_id,
                                                         bos_token_id=hf_tokenizer.bos_token_id)))
    model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    folder = qc.awq(model, tmp / "awq")
    hf_tokenizer.save_pretrained(folder)
    oracle = transformers.LlamaForCausalLM.from_pretrained(
        qc.dense_folder(folder, qc.awq_weights(folder, tmp / "as-ct"), tmp / "dense")).eval()
    stack = _start_stack(tmp_path_factory, "awq", 1, ["--model-path", str(folder), "--model", "awq-test"])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
        prompt = "The capital of France is"
        got = client.completions.create(model="awq-test", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].token_ids == transformers_greedy(oracle, hf_tokenizer.encode(prompt), 12)
        chosen = [json.loads(line) for line in (stack.log_dir / "worker-0.log").read_text().splitlines()
                  if '"engine_defaults"' in line]
        assert chosen and chosen[0]["quantization"] == "awq", chosen
    finally:
        stack.stop()
