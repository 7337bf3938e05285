"""Weight-only quantization on the C kernels: a GGUF's own blocks are its weights to the bit, and
every method, w8a8 too, keeps the model close to the float32 reference (the faster path is checked
against the torch path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.backends.torch_cpu.quantization import QuantLinear, quantize


@pytest.mark.parametrize(("method", "dtype"), [("int8", torch.bfloat16), ("int4", torch.bfloat16),
                                               ("int4", torch.float32), ("w8a8", torch.float32)])
def test_quantized_model_agrees_with_float32(loaded_model, default_model_path, hf_tokenizer, cpu_kernels, method,
                                            dtype):
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from tests.model_helpers import make_runner, prefill_logits
    from tests.test_llama_vs_hf import PROMPTS

    quant = load_model(default_model_path, dtype=dtype, ops=TORCH_OPS)
    quantize(quant.model, method)
    assert not any(isinstance(m, nn.Linear) for m in quant.model.modules())
    fast = make_runner(quant, num_blocks=64, kv_dtype=dtype, max_model_len=1024)
    reference = make_runner(loaded_model)
    agree = total = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours, theirs = prefill_logits(fast, ids).float(), prefill_logits(reference, ids)
        # the next token itself; where the reference's top two are a near tie (" def" 21.81 against
        # " fib" 21.77 after the fibonacci prompt), either of them
        top2 = theirs[-1].topk(2)
        near_tie = float(top2.values[0] - top2.values[1]) < 0.25
        assert int(ours[-1].argmax()) in (top2.indices.tolist() if near_tie else top2.indices[:1].tolist()), prompt
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
    # int4 and w8a8 are the lossier: 44/49 of the prompt positions for int4 on one VM, more on
    # another (the bf16 kernels differ by CPU), so their floor is lower
    assert agree / total >= (0.9 if method == "int8" else 0.85), f"{agree}/{total}"


TEXT = ("The river rose slowly through the night, and by morning the low fields on the east bank were under "
        "water. The farmers had moved their animals to the hill the day before, so nothing was lost but a "
        "week of work. In the village the talk was of the new bridge, which had stood against the flood "
        "while the old ford disappeared. Children walked along the bank to see how high the water had come, "
        "and the miller wrote the level on his wall beside the marks of earlier years. When the water went down, "
        "the bridge was the first thing the engineers from the town came to look at. They measured the stones of "
        "its piers, tapped the mortar with small hammers and wrote numbers in a book, and at the end of the second "
        "day they said it would stand for another hundred years. The miller did not believe them. He had seen the "
        "river take the mill race twice, and he knew that a flood did its damage slowly, under the surface, where "
        "no hammer could reach. That winter he built a wall of sandbags along the lane behind the mill, and the "
        "younger men laughed at him until the spring rains came. In March the river rose again, higher than anyone "
        "remembered, and the water stopped a hand's width below the top of his wall. After that, people listened "
        "when he talked about the river, and the council asked him to write down everything he knew about the "
        "floods of the past fifty years, which he did in a small green notebook that is kept today in the village "
        "library.")  # 308 tokens: over 100, a logit's bfloat16 rounding alone moved the perplexity by 0.4%


def _perplexity(runner, ids: list[int]) -> float:
    from tests.model_helpers import prefill_logits

    logits = prefill_logits(runner, ids).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(nll.exp())


@pytest.mark.parametrize(("method", "dtype"), [("gguf", torch.float32), ("gguf", torch.bfloat16),
                                               ("int4", torch.float32)])
def test_a_ggufs_own_blocks_are_kept_and_its_perplexity(loaded_model, default_model_path, hf_tokenizer, cpu_kernels,
                                                       method, dtype):
    """The default GGUF is Q4_1 with a Q8_0 head (tied to the embedding). `gguf` (what --quantization
    auto picks) and int4 take the file's values, scales and minimums as they are: the kernel's
    weights are the loader's floats to the bit (Q8_0's at 8 bits). The perplexity of a fixed text:
    float32 on the blocks is the dense reference's up to summation order; a bfloat16 model's stays
    within 0.5%."""
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.backends.torch_cpu.quantization import native_blocks
    from services.worker.loader import load_model
    from services.worker.loader.quant_blocks import for_module
    from tests.model_helpers import make_runner

    quant = load_model(default_model_path, dtype=dtype, ops=TORCH_OPS)
    float_weights = {n: m.weight.detach().clone() for n, m in quant.model.named_modules() if isinstance(m, nn.Linear)}
    blocks = native_blocks(quant, method)
    quantize(quant.model, method, blocks)
    layers = dict(quant.model.named_modules())
    assert not any(isinstance(m, nn.Linear) for m in quant.model.modules())  # every weight of this file is kept
    for name in ("layers.0.attention.wqkv", "layers.0.feed_forward.w13", "layers.29.feed_forward.w2", "output"):
        q = layers[name]
        assert isinstance(q, QuantLinear) and q.bits == (8 if name == "output" else 4)
        assert torch.equal(q.blocks.q, for_module(blocks, name).q)
        assert torch.equal(q.dequantized.to(dtype), float_weights[name])  # the file's weights
    ids = hf_tokenizer.encode(TEXT)
    reference = _perplexity(make_runner(loaded_model), ids)
    ppl = _perplexity(make_runner(quant, num_blocks=64, max_model_len=1024, kv_dtype=dtype), ids)
    print(f"\nperplexity: float32 {reference:.4f}, {method} {dtype} {ppl:.4f}")
    assert ppl == pytest.approx(reference, rel=1e-5 if dtype == torch.float32 else 0.005)
