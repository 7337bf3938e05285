"""llama.cpp's k-quants and IQ4 kept in their blocks (loader/gguf_kquants.py): the weights gguf's own
dequantize gives, to the bit; quant_linear on each type's format against torch's matmul in every
variant this CPU runs; a Llama whose tensors mix the types against transformers on the same weights.
The blocks are random bytes with small float16 scales (any bytes are a valid block), written with
the gguf package's writer; the oracle is gguf's dequantization and transformers, never our code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from services.worker.backends.quant_embedding import QuantEmbedding
from services.worker.backends.spec import weight_bytes
from services.worker.backends.torch_cpu.quantization import (
    QuantLinear,
    int8_activations,
    kept_weights,
    native_blocks,
    quantize,
)
from services.worker.loader.gguf_blocks import decode
from services.worker.loader.gguf_kquants import DECODERS

# where each type's float16 scales sit in its block (the other bytes are any values)
HALF_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,),
           "IQ4_XS": (0,), "Q8_0": (0,), "Q4_1": (0, 2)}
ROWS = [1, 2, 3, 4, 5, 12, 13, 40]  # as tests/cpu_kernels/test_quant_linear.py: every path of the kernels (quant_dot.c: passes of 4 or 8 rows)


def random_raw(kind: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """[rows, row bytes] of random blocks of `kind`, their float16 scales drawn around `scale`."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for at in HALF_AT[kind]:
        halves = (rng.standard_normal((rows, k // block)) * scale).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def int8_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Each `block` inputs as int8 times max|x| / 127 (llama.cpp's quantize_row_q8_0 at 32, q8_K at
    256), back as floats."""
    blocks = x.reshape(-1, x.shape[-1] // block, block)
    top = blocks.abs().amax(-1, keepdim=True)
    # 127 / top divided (a number over a tensor is torch's reciprocal times it: at times an ulp off,
    # and an ulp moves an exact half, x * 127 / top = 46.5, to its other side)
    q = torch.round(blocks * torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0))
    assert q.abs().max() <= 127
    return (q * (top / 127.0)).view_as(x)


def outputs_in_every_variant(layer, x: torch.Tensor, expected: torch.Tensor) -> dict[str, torch.Tensor]:
    """`layer`'s output for x in each variant this CPU runs; in each, every count of ROWS within
    float32's rounding of `expected`, and the first row's bits those it has alone."""
    previous = torch.ops.switchyard_cpu.variant()
    outputs = {}
    try:
        for variant in torch.ops.switchyard_cpu.variants():
            torch.ops.switchyard_cpu.use_variant(variant)
            alone = layer(x[:1])
            for m in ROWS:
                out = layer(x[:m])
                torch.testing.assert_close(out.double(), expected[:m], rtol=0, atol=1e-5 * float(expected.abs().max()))
                assert torch.equal(out[0], alone[0]), (variant, m)
            outputs[variant] = layer(x)
    finally:
        torch.ops.switchyard_cpu.use_variant(previous)
    return outputs


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_every_type_decodes_to_ggufs_own_dequantization_to_the_bit(kind):
    rng = np.random.default_rng(len(kind))
    raw = random_raw(kind, 16, 1024, rng)
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(16, 1024)
    got = decode(kind, raw)
    # + 0.0 makes every zero +0: Q3_K's u (d sc) + sc (-4d) is +0 where gguf's d sc q is -0 (d sc < 0)
    assert np.array_equal((got.dequantized.numpy() + 0.0).view(np.uint32), (want + 0.0).view(np.uint32))
    assert got.scale.shape == (16, 1024 // got.group)
    assert torch.equal(got.scale.to(got.scale_dtype), got.scale.to(got.scale.dtype))  # kept as the kernel stores it
    if got.supers is not None:  # two levels: the file's int8 per group, its float16 d (and -dmin) per 256
        assert got.scale_dtype == torch.int8 and got.scale.dtype == torch.int8
        assert torch.equal(got.supers.half().float(), got.supers)
        assert torch.equal(got.flat().dequantized, got.dequantized)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_an_embedding_table_of_every_type_looks_up_ggufs_rows(kind):
    raw = random_raw(kind, 24, 512, np.random.default_rng(5))
    table = QuantEmbedding(decode(kind, raw), torch.float32)
    ids = torch.tensor([[3, 0, 23], [7, 7, 11]])
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(24, 512))[ids]
    assert torch.equal(table(ids), want)
    if kind in ("Q5_K", "Q6_K"):  # nibbles two to a byte, the fifth (and sixth) bits eight to a byte
        assert table.q.shape == (24, 256) and table.planes.shape == (table.bits - 4, 24, 64)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_quant_linear_on_every_type_matches_the_matmul_in_every_variant(cpu_kernels, kind):
    """Each row one float32 sum in order: the same bits at every batch size, and in every variant
    with an FMA; within float32's rounding of the float64 matmul on gguf's weights."""
    n, k = 48, 512  # a panel past the last pair; a buffer of 128 inputs filled four times
    rng = np.random.default_rng(7)
    raw = random_raw(kind, n, k, rng)
    layer = QuantLinear(decode(kind, raw), None)
    flat = QuantLinear(decode(kind, raw).flat(), None)  # one level: the float32 products themselves
    if kind in ("Q5_K", "Q6_K"):  # its values in 5 (6) bits: the nibbles, then a plane of fifth (and sixth) bits
        assert layer.bits == int(kind[1]) and layer.qweight.shape == (n // 16, k // 2 + (layer.bits - 4) * k // 8, 16)
    if kind in ("Q3_K", "IQ4_NL", "IQ4_XS"):  # 4 bits: Q3_K's q + 4, IQ4's indices into its codebook
        assert layer.bits == 4 and layer.qweight.shape == (n // 16, k // 2, 16)
        assert (layer.codebook is not None) == kind.startswith("IQ4")
    weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k))
    assert torch.equal(layer.dequantized, weights)  # the kernel's layout round-trips
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    expected = x.double() @ weights.double().t()
    outputs = outputs_in_every_variant(layer, x, expected)
    flats = outputs_in_every_variant(flat, x, expected)
    assert all(torch.equal(outputs[v], flats[v]) for v in outputs)  # two levels of scales change no bit
    fma = [out for name, out in outputs.items() if name != "portable"]
    assert all(torch.equal(out, fma[0]) for out in fma[1:])


# a Q4_K_M-like mix (Q4_K, Q6_K for attn_v, ffn_down and the head), and every other type in layer 1
LAYER_TYPES = [
    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K", "up_proj": "Q4_K",
     "down_proj": "Q6_K"},
    {"q_proj": "Q5_K", "k_proj": "Q3_K", "v_proj": "Q2_K", "o_proj": "IQ4_XS", "gate_proj": "IQ4_NL",
     "up_proj": "Q8_0", "down_proj": "Q4_1"},
]


def test_a_fused_linears_neighbours_of_one_format_are_joined_and_no_others():
    """QuantBlocks.runs: Q4_K_M's q, k (Q4_K) and v (Q6_K) are two parts, the rows of each in order;
    one format apart (Q6_K, Q4_K, Q6_K) stays three; another input order (GPTQ's act-order) splits."""
    import dataclasses

    from services.worker.loader.quant_blocks import QuantBlocks

    rng = np.random.default_rng(21)
    q, k, v = (decode(kind, random_raw(kind, rows, 512, rng))
               for kind, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)))
    runs = QuantBlocks.runs([q, k, v])
    assert [(r.bits, r.q.shape[0]) for r in runs] == [(4, 96), (6, 32)]
    assert torch.equal(runs[0].dequantized, torch.cat([q.dequantized, k.dequantized]))
    assert torch.equal(runs[1].dequantized, v.dequantized)
    assert [r.q.shape[0] for r in QuantBlocks.runs([v, q, v])] == [32, 64, 32]
    two, three = (decode(kind, random_raw(kind, 16, 512, rng)) for kind in ("Q2_K", "Q3_K"))
    joined, = QuantBlocks.runs([two, three])  # Q3_K's 4-bit form (its -4d fits float16): Q2_K's format
    assert (two.span, three.span, joined.span) == (2, 3, 3)  # the CUDA backend packs 3 bits, not Q2_K's 2
    order = torch.randperm(512, generator=torch.Generator().manual_seed(1))
    permuted = [dataclasses.replace(b, perm=order) for b in (q, k)]
    assert len(QuantBlocks.runs(permuted)) == 1
    assert len(QuantBlocks.runs([permuted[0], dataclasses.replace(k, perm=order.flip(0))])) == 2
    assert len(QuantBlocks.runs([permuted[0], k])) == 2


def mixed_llama(tmp_path) -> tuple[object, str, dict[str, torch.Tensor]]:
    """A 2-layer Llama whose tensors are random blocks of LAYER_TYPES' types (the head Q6_K, the
    embedding Q4_K), written with gguf's writer: (transformers' model on the same weights, the file,
    its state dict)."""
    import transformers

    from tests import gguf_writer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(11)
    path = str(tmp_path / "mixed.gguf")
    writer = gguf_writer.header(hf, path, "llama")
    writer.add_rope_dimension_count(64)
    state = hf.state_dict()
    for name, tensor in state.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            out = f"blk.{i}.{gguf_writer.LAYER_NAMES[rest]}.{kind}"
            qtype = LAYER_TYPES[int(i)].get(rest.split(".")[-1])
        else:
            out = f"{gguf_writer.TOP_NAMES[stem]}.{kind}"
            qtype = {"lm_head": "Q6_K", "model.embed_tokens": "Q4_K"}.get(stem)
        if qtype is None:  # the norms, float32 as llama.cpp keeps them
            writer.add_tensor(out, tensor.float().numpy())
            continue
        rows, cols = tensor.shape
        raw = random_raw(qtype, rows, cols, rng, scale=1e-3 if qtype in ("Q8_0", "IQ4_NL", "Q4_1") else 2e-4)
        state[name] = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols))
        if stem.endswith(("q_proj", "k_proj")):  # llama.cpp's row order: the blocks' rows permuted
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            raw = gguf_writer.permute(raw, heads)
        writer.add_tensor(out, np.ascontiguousarray(raw), raw_dtype=GGMLQuantizationType[qtype])
    gguf_writer.finish(writer)
    hf.load_state_dict(state)
    return hf, path, state


def test_a_llama_of_mixed_blocks_keeps_each_and_matches_transformers(tmp_path, monkeypatch, cpu_kernels):
    """Every Linear keeps its file's blocks (QuantLinear, the type's bits and group), its weights
    transformers' to the bit, and the logits of a 64-token prompt transformers' within float32's
    rounding: the same weights, sums in another order."""
    pytest.importorskip("transformers")
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from tests.model_helpers import make_runner, prefill_logits

    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    hf, path, state = mixed_llama(tmp_path)

    loaded = load_model(path, ops=TORCH_OPS)
    blocks = native_blocks(loaded, "gguf")
    quantize(loaded.model, "gguf", blocks)
    layers = dict(loaded.model.named_modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())  # every weight kept
    assert [type(layers[f"layers.{i}.attention.wqkv"]).__name__ for i in (0, 1)] == ["QuantLinearParts"] * 2
    # Q4_K_M's mix: its Q4_K q and k one part (one kernel call), its Q6_K v the other
    qkv0 = layers["layers.0.attention.wqkv"]
    assert [(p.bits, p.out_features) for p in qkv0.parts] == [(4, 256 + 128), (6, 128)]
    w13 = layers["layers.1.feed_forward.w13"]  # IQ4_NL's indices beside Q8_0's values: two formats
    assert type(w13).__name__ == "QuantLinearParts" and [p.bits for p in w13.parts] == [4, 8]
    # the k-quants and IQ4_XS in two levels (int8 scales, float16 supers), Q4_1 in its float16 scales;
    # Q3_K as 4 bits (q + 4) with a low, IQ4 as 4-bit indices into its codebook
    expect = {"layers.0.attention.wo": (4, 32, torch.int8), "layers.0.feed_forward.w2": (6, 16, torch.int8),
              "layers.1.attention.wo": (4, 32, torch.int8), "layers.1.feed_forward.w2": (4, 32, torch.float16),
              "output": (6, 16, torch.int8), "layers.1.attention.wqkv.parts.1": (4, 16, torch.int8)}
    for name, (bits, group, dtype) in expect.items():
        layer = layers[name]
        assert (layer.bits, layer.group, layer.scales.dtype) == (bits, group, dtype), name
    assert layers["layers.1.attention.wo"].codebook is not None and w13.parts[0].codebook is not None
    assert torch.equal(layers["output"].dequantized, state["lm_head.weight"])
    assert torch.equal(layers["layers.1.attention.wo"].dequantized, state["model.layers.1.self_attn.o_proj.weight"])
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = prefill_logits(make_runner(loaded, num_blocks=16), ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5 * float(theirs.abs().max()))

    # as the worker loads it: the kept weights never dequantized, the embedding table in its blocks too
    worker = load_model(path, keep=kept_weights, ops=TORCH_OPS)
    assert "tok_embeddings.weight" in worker.unloaded and "output.weight" in worker.unloaded
    quantize(worker.model, "gguf", worker.blocks, worker.unloaded)
    assert type(worker.model.tok_embeddings).__name__ == "QuantEmbedding"
    assert torch.equal(prefill_logits(make_runner(worker, num_blocks=16), ids), ours)
    dense_bytes = sum(t.numel() * 4 for t in hf.state_dict().values())
    assert weight_bytes(worker.model) < 0.4 * dense_bytes

    # --quant-activations int8: the 4- to 6-bit weights take rows quantized to int8 as llama.cpp does
    # (per 256 inputs for the k-quants, Q8_K's; per 32 for the others), IQ4's and Q8_0's keep float
    # rows. The oracle, layer by layer on the inputs the model gives each: the float kernel on rows
    # quantized by int8_rows() in torch (the model's logits are no oracle: a float32 rounding one way or
    # the other moves a later layer's row to its next int8 step; tests/cpu_kernels/test_quant_dot.py
    # checks each format alone)
    takers = [m for m in worker.model.modules() if isinstance(m, QuantLinear) and m.takes_int8_rows]
    float_rows = {m: QuantLinear(m.blocks, m.bias) for m in takers}
    assert int8_activations(worker.model) == len(takers) == 9  # layer 1's Q3_K k and Q2_K v in one format: one part
    compared = []

    def against_float_rows(layer, args, out):
        want = float_rows[layer](int8_rows(args[0], layer.row_block))
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5 * float(want.abs().max()))
        compared.append(layer)

    hooks = [m.register_forward_hook(against_float_rows) for m in takers]
    quick = prefill_logits(make_runner(worker, num_blocks=16), ids)
    for hook in hooks:
        hook.remove()
    assert set(compared) == set(takers) and {m.row_block for m in takers} == {32, 256}
    assert not torch.allclose(quick, ours, rtol=0, atol=1e-3 * float(ours.abs().max()))


def test_int4_on_a_gguf_of_floats_quantizes_every_linear_to_4_bits(tmp_path, monkeypatch, cpu_kernels):
    """No kept block in the file: load_model(keep=...) gives no blocks, and int4 makes its own 4-bit ones."""
    transformers = pytest.importorskip("transformers")
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from tests import gguf_writer

    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config)
    path = str(tmp_path / "floats.gguf")
    writer = gguf_writer.header(hf, path, "llama")
    for name, tensor in hf.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        out = f"blk.{stem.split('.')[2]}.{gguf_writer.LAYER_NAMES[stem.split('.', 3)[3]]}.{kind}" \
            if stem.startswith("model.layers.") else f"{gguf_writer.TOP_NAMES[stem]}.{kind}"
        writer.add_tensor(out, tensor.float().numpy())
    gguf_writer.finish(writer)
    loaded = load_model(path, keep=kept_weights, ops=TORCH_OPS)
    assert loaded.blocks is None and not loaded.unloaded
    quantize(loaded.model, "int4", loaded.blocks, loaded.unloaded)
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.bits == 4 for m in linears)
