"""Writing a transformers checkpoint as llama.cpp's converter lays it out (float32 tensors), through the
gguf package's writer: the header every architecture shares, llama's Q/K row permutation, the close."""

from __future__ import annotations

import math

import numpy as np

# Hugging Face's layer tensor names -> llama.cpp's (the norm after attention is the MLP's norm in llama's layout)
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def header(model, path: str, arch: str):
    """A GGUFWriter with the config's geometry, rope base, eps and vocabulary written."""
    import gguf

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention") or c.rope_parameters
    w = gguf.GGUFWriter(path, arch)
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                       (w.add_rope_freq_base, rope["rope_theta"]), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_vocab_size, c.vocab_size)):
        add(value)
    return w


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's rotary halves (its llama architecture's Q and K rows)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.o_proj": "attn_output",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def phi3(model, path: str, q8_fused: bool = False):
    """phi3 as llama.cpp writes it: attn_qkv and ffn_up fused as the checkpoint has them (no Q/K
    permutation), the window, a partial rotary as rope.dimension_count; q8_fused: those two in
    Q8_0. Returns the writer, for a vocabulary to be added before `finish`."""
    import gguf

    c = model.config
    w = header(model, path, "phi3")
    w.add_rope_dimension_count(int(c.hidden_size // c.num_attention_heads * getattr(c, "partial_rotary_factor", 1.0)))
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    if rope.get("rope_type") == "longrope":  # as llama.cpp's converter: factors as tensors, its attention factor
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for kind in ("short", "long"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    for name, tensor in model.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, idx, rest = stem.split(".", 3)
            data = tensor.float().numpy()
            if q8_fused and rest in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                q8 = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(f"blk.{idx}.{PHI3_NAMES[rest]}.{kind}", gguf.quants.quantize(data, q8), raw_dtype=q8)
            else:
                w.add_tensor(f"blk.{idx}.{PHI3_NAMES[rest]}.{kind}", data)
        else:
            w.add_tensor(f"{TOP_NAMES[stem]}.{kind}", tensor.float().numpy())
    return w


def finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
