"""Quantized checkpoints of a small random Llama, written as their tools write them, with each one's
oracle: its weights as the format's own dequantization gives them, in float32.

- compressed-tensors (W4A16 by group or channel, symmetric or not; W8A8 int8; FP8): quantized with
  the library's own qparams (calculate_qparams) and packed by its ModelCompressor, as llm-compressor
  saves a model. Oracle: the library's own decompressor (its unpacking and (q - zero) * scale), the
  scales widened to float32 first (it computes in the scales' dtype, this engine in float32).
- AWQ (GEMM): no packer installs here (AutoAWQ needs CUDA builds), so ours, from AutoAWQ's documented
  layout. Oracle: compressed-tensors' own AutoAWQ converter (vLLM's contributors' reading of the
  format) turns the folder into compressed-tensors, then its decompressor as above.
- GPTQ: ours, from AutoGPTQ's documented layout (its v1 zero points stored minus one; act-order's
  g_idx). No library here reads it, so the oracle is the integers the packer was given:
  (q - zero) * scale over the groups g_idx names; a symmetric 4-bit checkpoint's qzeros are the
  0x77777777 words every such file on the Hub holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM: slot i of a word holds column AWQ_ORDER[i]


def tiny_llama(seed: int = 0, scale_dtype: torch.dtype = torch.bfloat16):
    """A random Llama in `scale_dtype` (so the quantizers' scales come out in it, as a bf16 model's do)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    return model.to(scale_dtype)


def linear_names(model) -> list[str]:
    return [f"model.layers.{i}.{name}" for i in range(model.config.num_hidden_layers) for name in LINEARS]


# --- compressed-tensors -----------------------------------------------------------------------


def compressed_tensors(model, out: Path, kind: str) -> Path:
    """kind: w4a16 (asymmetric, groups of 128), w4a16-sym, w4a16-channel, w8a8 (int8 by channel,
    dynamic int8 tokens), fp8 (e4m3 by channel, dynamic fp8 tokens)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    if kind.startswith("w4a16"):
        strategy = "channel" if kind.endswith("channel") else "group"
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=kind != "w4a16", strategy=strategy,
                                   group_size=128 if strategy == "group" else None)
        scheme, fmt = QuantizationScheme(targets=["Linear"], weights=weights), "pack-quantized"
    else:
        kind_of = "int" if kind == "w8a8" else "float"
        weights = QuantizationArgs(num_bits=8, type=kind_of, symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type=kind_of, symmetric=True, strategy="token", dynamic=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
        fmt = "int-quantized" if kind == "w8a8" else "float-quantized"
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config, show_progress=False)
    for name in linear_names(model):
        m = model.get_submodule(name)
        w = m.weight.data.float()
        groups = w.view(w.shape[0], -1, 128) if weights.strategy == "group" else w.view(w.shape[0], 1, -1)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).view(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zero.to(m.weight_zero_point.dtype).view(m.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def compressed_tensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    """{module: float32 weight} by compressed-tensors' own decompressor, scales widened to float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    scheme = next(iter(config.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(config.format)
    names = compressor.compression_param_names(scheme)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(file))
    out = {}
    for module in {n.rsplit(".", 1)[0] for n in tensors if n.endswith(("weight_packed", "weight_scale"))}:
        state = {p: tensors[f"{module}.{p}"] for p in names if f"{module}.{p}" in tensors}
        state["weight_scale"] = state["weight_scale"].float()
        out[module] = compressor.decompress(state, scheme)["weight"].float()
    return out


# --- AWQ --------------------------------------------------------------------------------------


def _pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[a, n] of 0..15 -> [a, n / 8] int32: word c holds columns 8c + order[i] at bits 4i."""
    a, n = values.shape
    v = values.to(torch.int64).view(a, n // 8, 8)[:, :, list(order)]
    words = sum(v[:, :, i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def _asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's and AutoGPTQ's 4-bit min-max quantization of w [out, in]: q [out, in] 0..15, zeros
    and float16 scales [out, groups]."""
    g = w.float().view(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    return q.view_as(w).to(torch.int32), zero.to(torch.int32), scale


def awq(model, out: Path, group: int = 128) -> Path:
    """An AutoAWQ GEMM checkpoint of `model`: qweight [in, out / 8], qzeros [groups, out / 8] packed in
    AWQ_ORDER, scales [groups, out] float16; the rest as transformers saves it."""
    model.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in linear_names(model):
        q, zero, scale = _asymmetric(tensors.pop(f"{name}.weight"), group)
        tensors[f"{name}.qweight"] = _pack_columns(q.T.contiguous(), AWQ_ORDER)
        tensors[f"{name}.qzeros"] = _pack_columns(zero.T.contiguous(), AWQ_ORDER)
        tensors[f"{name}.scales"] = scale.T.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(out, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm", "modules_to_not_convert": None})
    return out


def awq_weights(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The AWQ folder through compressed-tensors' AutoAWQConverter, then its decompressor."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    convert_checkpoint(str(folder), str(scratch), AutoAWQConverter.from_pretrained(str(folder)), max_workers=1,
                       device="cpu")
    return compressed_tensors_weights(scratch)


# --- GPTQ -------------------------------------------------------------------------------------


def gptq(model, out: Path, group: int = 128, act_order: bool = False, sym: bool = False,
         seed: int = 1) -> tuple[Path, dict[str, torch.Tensor]]:
    """An AutoGPTQ (v1) 4-bit checkpoint of `model` and its oracle weights. qweight [in / 8, out]
    packs 8 inputs a word; qzeros [groups, out / 8] packs outputs, each zero stored minus one;
    scales [groups, out] float16; g_idx [in]. act_order: the inputs are grouped in a random order
    (as GPTQ's desc_act groups them by the Hessian's diagonal), g_idx naming each one's group."""
    model.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    expected = {}
    for name in linear_names(model):
        w = tensors.pop(f"{name}.weight").float()
        n, k = w.shape
        order = torch.randperm(k, generator=generator) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)  # input order[j] is in group j // group
        q, zero, scale = _asymmetric(w[:, order], group)  # groups over the inputs in `order`
        if sym:
            zero = torch.full_like(zero, 8)
            q = torch.round(w[:, order] / scale.float().repeat_interleave(group, 1) + 8).clamp(0, 15).to(torch.int32)
        q_in_order = torch.empty_like(q)
        q_in_order[:, order] = q
        rows = q_in_order.T.contiguous().to(torch.int64).view(k // 8, 8, n)  # [in / 8, 8, out]
        words = sum(rows[:, i] << (4 * i) for i in range(8))
        tensors[f"{name}.qweight"] = (words - ((words >> 31) << 32)).to(torch.int32)
        tensors[f"{name}.qzeros"] = _pack_columns((zero - 1).T.contiguous() & 0xF)
        tensors[f"{name}.scales"] = scale.T.contiguous()
        tensors[f"{name}.g_idx"] = g_idx
        s = scale.float()[:, g_idx.long()]  # [out, in]: each input's group's scale
        expected[name] = (q_in_order - zero[:, g_idx.long()]).float() * s
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization_config(out, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                                   "sym": sym, "checkpoint_format": "gptq", "true_sequential": True})
    return out, expected


def _set_quantization_config(folder: Path, quantization_config: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2))


def dense_folder(model_folder: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """A float32 transformers folder of the quantized checkpoint's weights (the oracle's model)."""
    import transformers

    config = json.loads((model_folder / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in config.items()
                                                                       if k in TINY or k == "architectures"}))
    state = {}
    for file in sorted(model_folder.glob("*.safetensors")):
        state |= {k: v.float() for k, v in load_file(str(file)).items() if k.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight"))}
    state |= {f"{m}.weight": w for m, w in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.float().save_pretrained(out)
    return out
