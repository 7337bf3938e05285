"""Oracle: our Llama forward against Hugging Face transformers' LlamaForCausalLM, same GGUF."""

from __future__ import annotations

import os

import pytest
import torch

from tests.model_helpers import greedy_generate, make_runner, prefill_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


def test_logits_match_transformers(loaded_model, hf_model, hf_tokenizer):
    runner = make_runner(loaded_model)
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours = prefill_logits(runner, ids)
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


def test_greedy_continuations_match_transformers(loaded_model, hf_model, hf_tokenizer):
    runner = make_runner(loaded_model)
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        ours = greedy_generate(runner, ids, max_tokens=32)
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False, pad_token_id=2)
        assert ours == out[0, len(ids):].tolist(), prompt
